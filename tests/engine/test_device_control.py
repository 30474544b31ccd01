"""The device control step (Triton, under TRITON_INTERPRET=1 on CPU) is exact against the
expert cache's torch step: same pair slots, residency, LRU clocks, counters and slot contents,
across layers, fill fractions, a full pool and a resize."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import pytest  # noqa: E402
import torch  # noqa: E402

from freetoken_engine.cache.bank import ExpertBank
from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.cache.experts import ExpertCache
from freetoken_engine.kernels.triton.control import ControlOutputs, control_step, fill_table

LAYERS, EXPERTS, H, I, K = 3, 12, 16, 8, 4


def _bank(seed: int = 0, experts: int = EXPERTS) -> ExpertBank:
    bank = ExpertBank(LAYERS, experts, H, I, torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    bank.w13.copy_(torch.randn(bank.w13.shape, generator=g))
    bank.w2.copy_(torch.randn(bank.w2.shape, generator=g))
    return bank


def _warm_controls(bank: ExpertBank, seed: int, count: int) -> list[DeviceControl]:
    """``count`` device controls over 7-slot pools (q* 0.5, admission window 1), each after the
    same three warm-up steps of every layer (``_routing`` of 2 tokens over 10 hot experts)."""
    g = torch.Generator().manual_seed(seed)
    warm = [(layer, _routing(g, 2, 10)) for _ in range(3) for layer in range(LAYERS)]
    ctls = []
    for _ in range(count):
        ctl = DeviceControl.from_cache(ExpertCache(bank, 7, "cpu", fill_fraction=0.5, admit_window=1))
        for layer, ids in warm:
            ctl.step(layer, ids)
        ctls.append(ctl)
    return ctls


def _routing(g: torch.Generator, tokens: int, hot: int) -> torch.Tensor:
    """Top-k ids drawn from the first ``hot`` experts: repeats across steps give hits."""
    return torch.stack([torch.randperm(hot, generator=g)[:K] for _ in range(tokens)])


def _assert_same(ref: ExpertCache, dev: ExpertCache, ctl: DeviceControl) -> None:
    assert torch.equal(ctl.slot_of, ref.slot_of)
    assert torch.equal(ctl.slot_owner, ref.slot_owner)
    assert torch.equal(ctl.last_used, ref.last_used)
    assert ctl.host_clock() == ref.clock
    live = ref.slot_owner >= 0
    assert torch.equal(dev.w13[live], ref.w13[live]) and torch.equal(dev.w2[live], ref.w2[live])


@pytest.mark.parametrize("capacity,fill_fraction", [(10, 1.0), (10, 0.7), (5, 0.5), (4, 1.0)])
def test_device_step_matches_cache_step(capacity, fill_fraction):
    bank = _bank()
    ref = ExpertCache(bank, capacity, "cpu", fill_fraction=fill_fraction)
    dev = ExpertCache(bank, capacity, "cpu", fill_fraction=fill_fraction)
    ctl = DeviceControl.from_cache(dev)
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


def test_a_prefetch_changes_residency_as_the_step_would_and_nothing_else():
    """``prefetch(layer, guess)``: the fills, victims and slot contents the layer's step on those
    ids would make, stamped with that step's clock, but the clock, the counters and the routing
    history stay; the counts go to the prefetch counters. The real step on the same ids then
    finds every filled guess resident, and a prefetch never evicts a slot the step before used."""
    ahead, plain = _warm_controls(_bank(), 5, 2)
    before = ahead.outputs(2 * K).fill_slot.clone()
    used = ahead.last_used == ahead.host_clock() - 1           # the slots the last step used
    owners = ahead.slot_owner.clone()
    clock, totals, history = ahead.host_clock(), ahead.counters(), ahead.last_active.clone()
    guess = torch.tensor([[9, 10, 11, 0], [1, 9, 10, 2]])
    ahead.prefetch(1, guess)
    plain.step(1, guess)
    assert torch.equal(ahead.slot_of, plain.slot_of) and torch.equal(ahead.slot_owner, plain.slot_owner)
    # stamped with the clock before the coming step's (the running step's): the guessed layer's
    # own step must find every stored clock below its own
    assert torch.equal(ahead.last_used, torch.where(plain.last_used == clock, clock - 1, plain.last_used))
    assert torch.equal(ahead.w13_slots, plain.w13_slots) and torch.equal(ahead.w2_slots, plain.w2_slots)
    assert ahead.host_clock() == clock and plain.host_clock() == clock + 1
    assert ahead.counters() == totals and torch.equal(ahead.last_active, history)
    assert torch.equal(ahead.outputs(2 * K).fill_slot, before)    # the shared outputs untouched
    pf = ahead.prefetch_counters()
    assert pf["fills"] > 0 and pf["cpu_computed"] > 0 and pf == {k: v - totals[k] for k, v in plain.counters().items()}
    assert torch.equal(ahead.slot_owner[used], owners[used])      # the running step's slots kept
    filled = ahead._prefetch_out[2 * K].fill_exp[ahead._prefetch_out[2 * K].fill_exp >= 0]
    out = ahead.step(1, guess)
    assert bool((ahead.slot_of[1, filled] >= 0).all()) and out.step_counts[1] == pf["misses"] - pf["fills"]
    with pytest.raises(ValueError, match="prefetch step needs admit_window"):
        control_step(1, guess, ahead.slot_of, ahead.slot_owner, ahead.last_used, ahead.clock, ahead.fill_table,
                     ahead.prefetch_totals, ControlOutputs.allocate(2 * K, EXPERTS, 7, torch.device("cpu")),
                     admit_window=0, prefetch=True)


def test_a_prefetch_and_its_step_fill_what_the_step_alone_would():
    """The guessed layer's step counts the prefetch's fills against its PCIe share: with right
    guesses, the prefetch and the step together fill, and leave to the CPU, exactly what the step
    alone fills and leaves; with guesses that were all resident (the call's hits: no prefetch
    fill) the step keeps its whole share (a rule of "fill nothing after a prefetch" halved the
    H200 engine's speed with a predictor like that: its guesses hit, and every miss went to the
    CPU)."""
    ids = torch.tensor([[9, 10, 11, 0], [1, 9, 10, 2]])
    alone, right, resident = _warm_controls(_bank(4), 2, 3)
    want = alone.step(1, ids).step_counts.tolist()                 # hits, misses, fills, CPU
    assert want[2] > 0 and want[3] > 0
    right.prefetch(1, ids)
    pf = right.prefetch_counters()
    got = right.step(1, ids).step_counts.tolist()
    assert pf["fills"] > 0 and got[0] == want[0] + pf["fills"]
    assert pf["fills"] + got[2] == want[2] and got[3] == want[3]
    routed = ids.unique()
    held = routed[resident.slot_of[1, routed] >= 0].reshape(1, -1)      # the call's hits: right, resident
    resident.prefetch(1, held)
    assert resident.prefetch_counters()["fills"] == 0
    assert resident.step(1, ids).step_counts.tolist() == want


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_after_prefetches_every_pair_reads_its_own_expert(fraction):
    """Steps that each follow a prefetch of mostly wrong guesses, in a pool of 12 slots for 24
    experts a layer, steps of 4 and 8 distinct experts in turn (with every miss filled, fraction
    1, there is no admission window: every slot may be a victim, and a step can need more than
    the slots older than the prefetch): every pair's slot holds that pair's expert after its
    step, i.e. none of the step's hits was taken for a fill, and the slots hold the bank's rows.
    (A prefetch that stamped with the step's own clock tied its wrong guesses with the step's
    hits, and a hit with the lower slot number became a victim.)"""
    experts = 24
    bank = _bank(3, experts)
    g = torch.Generator().manual_seed(11)
    ctl = DeviceControl.from_cache(ExpertCache(bank, 3 * K, "cpu", fill_fraction=fraction, admit_window=1))
    filled = 0
    for step in range(36):
        layer = step % LAYERS
        perm = torch.randperm(experts, generator=g)
        tokens = 1 + step % 2
        ids = perm[:tokens * K].reshape(tokens, K)                     # distinct: 4 or 8 experts
        if step:      # a quarter of them guessed, the rest wrong
            right = ids.reshape(-1)[: tokens * K // 4]
            guess = torch.cat([right, perm[tokens * K: tokens * K + tokens * K - right.numel()]])
            ctl.prefetch(layer, guess.reshape(tokens, K))
        out = ctl.step(layer, ids)
        ps = out.pair_slot
        on_gpu = ps >= 0
        if fraction == 1.0:
            assert bool(on_gpu.all())
        assert torch.equal(ctl.slot_owner[ps[on_gpu]], layer * experts + ids.reshape(-1)[on_gpu])
        for p in torch.nonzero(on_gpu).flatten().tolist():
            assert torch.equal(ctl.w13_slots[ps[p]], bank.w13[layer, int(ids.reshape(-1)[p])])
        filled += int(out.step_counts[2])
    assert filled > 0 and ctl.prefetch_counters()["fills"] > 0


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
