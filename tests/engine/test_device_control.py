"""The device control step (Triton, under TRITON_INTERPRET=1 on CPU) is exact against the
expert cache's torch step: same pair slots, residency, LRU clocks, counters and slot contents,
across layers, fill fractions, a full pool and a resize."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import pytest  # noqa: E402
import torch  # noqa: E402

from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.cache.experts import ExpertCache
from freetoken_engine.kernels.triton.control import control_step
from freetoken_engine.kernels.triton.control_outputs import ControlOutputs, fill_table

from control_cases import EXPERTS, H, K, LAYERS, bank as _bank, routing as _routing

def _assert_same(ref: ExpertCache, dev: ExpertCache, ctl: DeviceControl) -> None:
    assert torch.equal(ctl.slot_of, ref.slot_of)
    assert torch.equal(ctl.slot_owner, ref.slot_owner)
    assert torch.equal(ctl.last_used, ref.last_used)
    assert ctl.host_clock() == ref.clock
    live = ref.slot_owner >= 0
    assert torch.equal(dev.w13[live], ref.w13[live]) and torch.equal(dev.w2[live], ref.w2[live])


@pytest.mark.parametrize("capacity,fill_fraction,speed", [(10, 1.0, None), (10, 0.7, None), (5, 0.5, None),
                                                          (4, 1.0, None), (10, 0.6, (1.0, 1.6, 2.0))])
def test_device_step_matches_cache_step(capacity, fill_fraction, speed):
    bank = _bank()
    ref = ExpertCache(bank, capacity, "cpu", fill_fraction=fill_fraction)
    dev = ExpertCache(bank, capacity, "cpu", fill_fraction=fill_fraction)
    ref.cpu_speed = dev.cpu_speed = speed        # the CPU's call-size curve (kernels/split.py)
    ctl = DeviceControl.from_cache(dev)
    if speed:   # a CPU that runs 2-expert calls 1.6x faster takes more of each call than f says
        assert ctl.fill_table.tolist()[:9] == [0, 1, 1, 1, 2, 2, 2, 3, 3]
    g = torch.Generator().manual_seed(capacity)
    for step in range(8):
        for layer in range(LAYERS):
            ids = _routing(g, tokens=1 + step % 3, hot=8)
            was_resident = ref.slot_of[layer, ids.reshape(-1)] >= 0
            want = ref.step(layer, ids.reshape(-1))
            out = ctl.step(layer, ids)
            assert torch.equal(out.pair_slot, want), (step, layer)
            assert torch.equal(out.pair_hit_slot, torch.where(was_resident, want, -1))
            assert torch.equal(out.pair_fill_slot, torch.where(~was_resident & (want >= 0), want, -1))
            n_fill = int((out.fill_exp >= 0).sum())
            n_cpu = int((out.cpu_exp >= 0).sum())
            assert out.step_counts.tolist()[2:] == [n_fill, n_cpu]
    _assert_same(ref, dev, ctl)
    counters = ctl.counters()
    assert counters == {"hits": ref.stats.hits, "misses": ref.stats.misses,
                        "fills": ref.stats.fills, "cpu_computed": ref.stats.cpu_computed}
    # A fraction below 1, or a pool smaller than a call's experts, sends misses to the CPU.
    assert (counters["cpu_computed"] > 0) == (fill_fraction < 1.0 or capacity <= K)
    ctl.write_back(dev)
    dev.check_integrity(deep=True)
    assert dev.stats == ref.stats


def test_a_step_into_the_callers_outputs_leaves_the_shared_ones_alone():
    """``step(out=)``: a layer's control step run ahead of the previous layer's use of its outputs
    (bench/offload_decode.py ``/ahead``) writes the caller's buffers, gives what the shared ones
    would have held, and does not touch the shared buffers another layer is still reading."""
    bank = _bank()
    runs = []
    for own in (False, True):
        ctl = DeviceControl.from_cache(ExpertCache(bank, 6, "cpu", fill_fraction=0.5))
        g = torch.Generator().manual_seed(3)
        outs = [ControlOutputs.allocate(2 * K, EXPERTS, 6, torch.device("cpu")) for _ in range(2)] if own else None
        seen = []
        for step in range(4):
            for layer in range(LAYERS):
                shared = ctl.outputs(2 * K).pair_slot.clone()
                out = ctl.step(layer, _routing(g, 2, 9), out=outs[layer % 2] if own else None)
                if own:
                    assert out is outs[layer % 2] and torch.equal(ctl.outputs(2 * K).pair_slot, shared)
                seen.append((out.pair_slot.clone(), out.fill_exp.clone(), out.step_counts.clone()))
        runs.append((seen, ctl.counters()))
    assert all(torch.equal(a, b) for x, y in zip(runs[0][0], runs[1][0]) for a, b in zip(x, y))
    assert runs[0][1] == runs[1][1] and runs[0][1]["fills"] > 0 and runs[0][1]["cpu_computed"] > 0


@pytest.mark.parametrize("resizable", [False, True])
def test_device_state_survives_resize(resizable):
    # resizable (the engine's binding): the control kernel is sized once for every expert, so a
    # resize under memory pressure compiles nothing new (tests/gpu checks that on a GPU)
    bank = _bank(1)
    ref = ExpertCache(bank, 9, "cpu", fill_fraction=0.8)
    dev = ExpertCache(bank, 9, "cpu", fill_fraction=0.8)
    ctl = DeviceControl.from_cache(dev, resizable=resizable)
    assert ctl.max_slots == (LAYERS * EXPERTS if resizable else None)
    g = torch.Generator().manual_seed(7)
    for capacity in (9, 4, 14, LAYERS * EXPERTS):      # a game starts, takes more, quits
        ctl.write_back(dev)                           # the safe point: hand state to the cache
        ref.resize(capacity)
        dev.resize(capacity)
        ctl.refresh(dev)                              # new pool and residency tensors
        for _ in range(4):
            for layer in range(LAYERS):
                ids = _routing(g, tokens=2, hot=10)
                assert torch.equal(ctl.step(layer, ids).pair_slot, ref.step(layer, ids.reshape(-1)))
        _assert_same(ref, dev, ctl)
    ctl.write_back(dev)
    dev.check_integrity(deep=True)
    assert dev.stats == ref.stats


@pytest.mark.parametrize("admit_window", [0, LAYERS], ids=["lru", "admission"])
def test_device_fill_admission_matches_cache(admit_window):
    """The cyclic scan (every step routes the same 6 experts in each layer, 18 > 8 slots, nearly
    every miss filled): the kernel refuses the same fills as the cache (victims used within the
    last step), so pair slots, residency and clocks stay identical; plain LRU there hits nothing."""
    bank = _bank(3)
    ref = ExpertCache(bank, 8, "cpu", fill_fraction=0.99, admit_window=admit_window)
    dev = ExpertCache(bank, 8, "cpu", fill_fraction=0.99, admit_window=admit_window)
    ctl = DeviceControl.from_cache(dev)
    ids = torch.arange(6).view(1, 6)
    for step in range(5):
        for layer in range(LAYERS):
            want = ref.step(layer, ids.reshape(-1))
            assert torch.equal(ctl.step(layer, ids).pair_slot, want), (step, layer)
            _assert_same(ref, dev, ctl)
    counters = ctl.counters()
    assert counters == {k: getattr(ref.stats, k) for k in counters}
    assert (counters["hits"] > 0) == (admit_window > 0)
    assert (counters["fills"] < counters["misses"]) == (admit_window > 0)       # refused fills went to the CPU


def test_block_slots_below_the_pool_is_refused():
    slot_of = torch.full((1, 4), -1, dtype=torch.int64)
    owner, last = torch.full((8,), -1, dtype=torch.int64), torch.full((8,), -1, dtype=torch.int64)
    out = ControlOutputs.allocate(2, 4, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="block_slots 4 < the pool's 8 slots"):
        control_step(0, torch.tensor([[0, 1]]), slot_of, owner, last, torch.zeros(1, dtype=torch.int64),
                     fill_table(1.0, 4, torch.device("cpu")), torch.zeros(4, dtype=torch.int64), out,
                     block_slots=4)


def test_host_mirror_receives_pair_slots_and_counts():
    """The CPU branch reads which pairs it computes from the mirror: it must equal the outputs."""
    dev = ExpertCache(_bank(2), 5, "cpu", fill_fraction=0.5)
    ctl = DeviceControl.from_cache(dev)
    g = torch.Generator().manual_seed(11)
    mirror = (torch.full((2 * K,), -7, dtype=torch.int64), torch.full((4,), -7, dtype=torch.int64),
              torch.full((2 * K,), -7, dtype=torch.int64))
    for _ in range(3):
        for layer in range(LAYERS):
            ids = _routing(g, tokens=2, hot=10)
            out = ctl.step(layer, ids, mirror=mirror)
            assert torch.equal(mirror[0], out.pair_slot) and torch.equal(mirror[1], out.step_counts)
            assert torch.equal(mirror[2], ids.reshape(-1))        # the experts of the CPU's pairs
    with pytest.raises(ValueError, match="mirror pair_slot"):
        ctl.step(0, _routing(g, tokens=2, hot=10), mirror=(mirror[0][:-1], mirror[1]))
    with pytest.raises(ValueError, match="mirror pair_exp"):
        ctl.step(0, _routing(g, tokens=2, hot=10), mirror=(mirror[0], mirror[1], mirror[2][:-1]))


def test_fill_fraction_is_validated():
    dev = ExpertCache(_bank(), 6, "cpu")
    ctl = DeviceControl.from_cache(dev)
    with pytest.raises(ValueError, match="fill_fraction"):
        ctl.set_fill_fraction(1.5)


def test_layer_streamer_on_cpu_returns_bank_views():
    from freetoken_engine.cache.prefetch import LayerStreamer, _runs
    bank = _bank(2)
    streamer = LayerStreamer(bank, "cpu")
    for layer in (0, 2, 1):
        w13, w2 = streamer.layer(layer)
        assert w13.data_ptr() == bank.w13[layer].data_ptr() and w2.data_ptr() == bank.w2[layer].data_ptr()
    with pytest.raises(ValueError, match="out of range"):
        streamer.layer(LAYERS)
    assert _runs(torch.tensor([True, True, False, True, False, False, True])) == [(0, 2), (3, 4), (6, 7)]


@pytest.mark.parametrize("capacity,fill_fraction", [(10, 0.6), (LAYERS * EXPERTS, 1.0)], ids=["cache-smaller-than-bank", "all-fit"])
def test_all_resident_reads_nothing_and_leaves_the_cache_as_it_was(capacity, fill_fraction):
    """Decode graphs are captured while a packed bank is still being read, with every expert
    resident: their steps must neither fill from the bank (it is not there yet, nor pinned) nor
    leave pairs to the CPU, and afterwards the cache must go on exactly as if they never ran."""
    bank = _bank(3)
    ref = ExpertCache(bank, capacity, "cpu", fill_fraction=fill_fraction)
    dev = ExpertCache(bank, capacity, "cpu", fill_fraction=fill_fraction)
    ctl = DeviceControl.from_cache(dev)
    g = torch.Generator().manual_seed(5)
    for layer in range(LAYERS):                       # some residency and clock to keep
        ids = _routing(g, tokens=2, hot=EXPERTS)
        assert torch.equal(ctl.step(layer, ids).pair_slot, ref.step(layer, ids.reshape(-1)))
    pools = (dev.w13.clone(), dev.w2.clone())
    counts = ctl.counters()
    bank.w13.fill_(float("nan"))                      # what a read still in progress may hold
    with ctl.all_resident():
        for _ in range(3):
            for layer in range(LAYERS):
                out = ctl.step(layer, _routing(g, tokens=3, hot=EXPERTS))
                assert bool((out.pair_slot >= 0).all()) and bool((out.pair_slot < ctl.slot_owner.numel()).all())
                assert bool((out.fill_exp < 0).all()) and bool((out.cpu_exp < 0).all())
    for pool, before in zip((dev.w13, dev.w2), pools):   # nothing was copied (bits: empty slots may hold NaN)
        assert torch.equal(pool.view(torch.int16), before.view(torch.int16))
    assert ctl.counters() == counts
    bank.w13.copy_(_bank(3).w13)
    _assert_same(ref, dev, ctl)
    for _ in range(2):                                # and it goes on as the reference does
        for layer in range(LAYERS):
            ids = _routing(g, tokens=2, hot=EXPERTS)
            assert torch.equal(ctl.step(layer, ids).pair_slot, ref.step(layer, ids.reshape(-1)))
    _assert_same(ref, dev, ctl)


@pytest.mark.parametrize("fill_fraction", [1.0, 0.5])
def test_hits_beside_the_fills_give_the_rows_of_one_call(fill_fraction, monkeypatch):
    """``run_experts``: the hits computed before the fills are copied (beside them, on a GPU's
    side stream), then the filled experts, write the same rows, bit for bit, as one call over every
    pair after the copies; the fills' rows come from the copied weights; ``beside`` runs once."""
    from freetoken_engine.kernels.reference import expert_pairs_forward
    bank = _bank(3)
    caches = [ExpertCache(bank, 14, "cpu", fill_fraction=fill_fraction) for _ in range(2)]
    ctls = [DeviceControl.from_cache(c) for c in caches]
    g = torch.Generator().manual_seed(5)
    order, calls, seen = [], [], {"hits": 0, "fills": 0}
    copy = ctls[0].copy
    monkeypatch.setattr(ctls[0], "copy", lambda *a: (order.append("copy"), copy(*a)))
    for step in range(6):
        t = 1 + step % 2
        tok = torch.arange(t).repeat_interleave(K)
        for layer in range(LAYERS):
            x = torch.randn(t, H, generator=g).to(torch.bfloat16)
            ids = _routing(g, t, hot=7)
            rows = []
            for overlap, ctl in zip((True, False), ctls):
                monkeypatch.setattr(DeviceControl, "overlap_hits", overlap)
                out = ctl.step(layer, ids, copy=False)
                got, extra = ctl.run_experts(layer, x, tok, out, beside=lambda: calls.append(overlap) or "shared")
                assert extra == "shared"
                rows.append((got, out.pair_slot.clone()))
            (a, slots), (b, slots_b) = rows
            assert torch.equal(slots, slots_b)
            dev = slots >= 0
            assert torch.equal(a[dev], b[dev]), (step, layer)
            want = expert_pairs_forward(x, bank.w13[layer], bank.w2[layer], tok[dev], ids.reshape(-1)[dev])
            assert torch.allclose(a[dev].float(), want.float(), atol=2e-2 * want.abs().max().item())
            seen["hits"] += int((out.pair_hit_slot >= 0).sum())
            seen["fills"] += int((out.pair_fill_slot >= 0).sum())
    assert calls == [True, False] * (6 * LAYERS)
    assert order == ["copy"] * (6 * LAYERS)
    assert seen["hits"] > 0 and seen["fills"] > 0      # both halves ran


def test_routing_history_is_kept_while_every_miss_is_filled():
    """The recurrence order needs the routing of the step before; a fills-only stretch (f = 1,
    where the order is off) still records it, so the first q* step after the split is set again
    picks the same fills on the device as the cache's torch step."""
    bank = _bank(4)
    ref = ExpertCache(bank, 6, "cpu", fill_fraction=1.0)
    dev = ExpertCache(bank, 6, "cpu", fill_fraction=1.0)
    ctl = DeviceControl.from_cache(dev)
    g = torch.Generator().manual_seed(11)
    for step in range(6):
        if step == 3:
            assert torch.equal(ctl.last_active, ref.last_active) and bool((ref.last_active >= 0).any())
            ref.fill_fraction = 0.4
            ctl.set_fill_fraction(0.4)
        for layer in range(LAYERS):
            ids = _routing(g, tokens=1 + step % 2, hot=EXPERTS)
            assert torch.equal(ctl.step(layer, ids).pair_slot, ref.step(layer, ids.reshape(-1))), (step, layer)
    assert torch.equal(ctl.last_active, ref.last_active)
    _assert_same(ref, dev, ctl)


@pytest.mark.parametrize("skip", [True, False], ids=["skip-scan", "always-scan"])
@pytest.mark.parametrize("admit_window", [0, LAYERS], ids=["lru", "admission"])
def test_calls_of_hits_only_skip_the_pool_scan_and_change_nothing(skip, admit_window, monkeypatch):
    """A call whose experts are all resident skips the kernel's pool-wide scan (every slot's
    clock, the admissible count, the victims' rounds; ``SKIP_WITHOUT_MISSES``, the default): the
    steps that follow still choose exactly the cache's victims, with and without the skip."""
    from freetoken_engine.kernels.triton import control
    monkeypatch.setattr(control, "SKIP_WITHOUT_MISSES", skip)
    bank = _bank(4)
    ref = ExpertCache(bank, 24, "cpu", fill_fraction=0.99, admit_window=admit_window)
    dev = ExpertCache(bank, 24, "cpu", fill_fraction=0.99, admit_window=admit_window)
    ctl = DeviceControl.from_cache(dev)
    g = torch.Generator().manual_seed(7)
    hot = torch.arange(K).view(1, K)                  # the same K experts: all hits once filled
    all_hit = fills_after_all_hit = 0
    for step in range(6):
        for layer in range(LAYERS):
            for ids in (hot, _routing(g, tokens=1, hot=EXPERTS)):
                resident = bool((ref.slot_of[layer, ids.reshape(-1)] >= 0).all())
                want = ref.step(layer, ids.reshape(-1))
                out = ctl.step(layer, ids)
                assert torch.equal(out.pair_slot, want), (step, layer)
                all_hit += resident
                fills_after_all_hit += bool(all_hit) and int((out.fill_exp >= 0).sum())
    _assert_same(ref, dev, ctl)
    assert all_hit > 0 and fills_after_all_hit > 0
    assert ctl.counters() == {k: getattr(ref.stats, k) for k in ctl.counters()}


@pytest.mark.parametrize("capacity", [LAYERS * EXPERTS, 16])
def test_a_prefill_fills_the_empty_slots_a_layer_at_a_time_and_evicts_nothing(capacity):
    """A long prompt's whole-layer calls fill an empty pool from their layer buffers
    (``fill_free``): each layer takes its share of the pool (the whole layer when every expert
    fits), its most routed experts first, with the bank's rows; a full pool takes nothing and
    stops looking (no more host syncs), so decode's residents are never evicted by a prefill.
    The filled slots are the first victims of a decode step that must evict."""
    bank = _bank()
    cache = ExpertCache(bank, capacity, "cpu")
    ctl = DeviceControl.from_cache(cache)
    share = EXPERTS if capacity == LAYERS * EXPERTS else capacity // LAYERS
    g = torch.Generator().manual_seed(3)
    hot = torch.tensor([7, 2, 9])                      # routed by every token: the first to be kept
    for layer in range(LAYERS):
        ids = torch.cat([hot.expand(6, 3), torch.randint(0, EXPERTS, (6, K - 3), generator=g)], dim=1)
        assert ctl.fill_free(layer, ids, bank.w13[layer], bank.w2[layer]) == share
        row = ctl.slot_of[layer]
        assert int((row >= 0).sum()) == share
        assert bool((row[hot] >= 0).all())
        assert ctl.fill_free(layer, ids, bank.w13[layer], bank.w2[layer]) == 0   # its share is taken
    assert ctl.host_clock() == 0                          # the clock does not move, and the filled
    assert bool((ctl.last_used == -1).all())              # slots count as never used by a step
    ctl.write_back(cache)
    cache.check_integrity(deep=True)
    owners = ctl.slot_owner.clone()
    empty = int((owners < 0).sum())
    assert empty == capacity - LAYERS * share
    if empty:                       # the rest of the slots stay for decode's fills
        hits = torch.nonzero(ctl.slot_of[1] >= 0).flatten()[:2]
        ctl.step(1, hits[None].repeat(1, 2)[:, :K])      # a decode step uses two of layer 1's experts
        used = ctl.slot_of[1, hits].clone()
        misses = torch.nonzero(ctl.slot_of[2] < 0).flatten()[:K]
        out = ctl.step(2, misses[None])                  # four misses: one empty slot, then prefill's
        victims = out.fill_slot[out.fill_slot >= 0]
        assert victims.numel() == K and not bool(torch.isin(victims, used).any())
        assert bool((ctl.slot_of[1, hits] == used).all())
        return
    assert ctl.fill_free(0, ids, bank.w13[0], bank.w2[0]) == 0 and ctl._full
    ctl.slot_owner.fill_(-1)        # were it to look again, it would fill: it does not (no sync)
    assert ctl.fill_free(0, ids, bank.w13[0], bank.w2[0]) == 0
