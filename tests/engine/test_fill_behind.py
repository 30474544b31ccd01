"""Fills behind the CPU (``kernels/triton/behind.py``, ``cache/behind.py``; Triton under
TRITON_INTERPRET=1 on CPU): the plan kernel against its Python reference, the staged bytes,
residency only once every word is in, outputs unchanged, fewer misses, a cache that checks out
mid-copy, and the engine's tokens."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import pytest  # noqa: E402
import torch  # noqa: E402

from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.cache.experts import ExpertCache
from freetoken_engine.kernels.triton.behind import FINALIZE, cpu_time_table
from freetoken_engine.kernels.triton.moe import moe_slots_forward

from control_cases import EXPERTS, H, K, LAYERS, bank as _bank, routing as _routing

WORDS = (2 * 8 * H * 2 + H * 8 * 2) // 8        # one expert's w13 and w2 in 8-byte words (I = 8, bf16)


def _plan_reference(st: dict, layer: int, counts: list[int], cpu_exp: list[int], cpu_time: list[float],
                    safety: float, window: int = 0) -> None:
    """Steps 1-3 of the kernel's docstring on plain Python lists (``st``: state, slot_of (flat),
    owner, last_used, clock)."""
    owner, v, _, hi, copied, resident, _ = st["state"]
    now, fin = st["clock"] - 1, 0
    if owner >= 0 and st["slot_of"][owner] >= 0:            # filled meanwhile: dropped
        owner = -1
    elif owner >= 0 and hi >= WORDS:
        idle = [(lu, s) for s, lu in enumerate(st["last_used"]) if lu < now and (window <= 0 or lu < now - window)]
        if idle:
            v = min(idle)[1]
            if st["owner"][v] >= 0:
                st["slot_of"][st["owner"][v]] = -1
            st["slot_of"][owner], st["owner"][v], st["last_used"][v] = v, owner, now
            resident, fin, owner = resident + 1, 1, -1
    budget = int(safety * max(cpu_time[counts[3]] - counts[2], 0.0) * WORDS)
    if owner < 0 and not fin and counts[3] > 0 and budget > 0:
        owner, hi = layer * EXPERTS + cpu_exp[0], 0
    lo = hi
    if owner >= 0:
        hi = min(hi + budget, WORDS)
    st["state"] = [owner, v, lo, hi, copied + hi - lo, resident, fin]


def _words(t13: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    """An expert's rows as its 8-byte words, w13's then w2's."""
    return torch.cat([t13.reshape(-1).view(torch.int64), t2.reshape(-1).view(torch.int64)])


def _snapshot(ctl: DeviceControl) -> dict:
    return {"state": ctl.behind.state.tolist(), "slot_of": ctl.slot_of.view(-1).tolist(),
            "owner": ctl.slot_owner.tolist(), "last_used": ctl.last_used.tolist(), "clock": ctl.host_clock()}


def _control(capacity: int, fill_fraction: float = 0.3, safety: float | None = 0.8, seed: int = 0, **cache):
    bank = _bank(seed)
    ctl = DeviceControl.from_cache(ExpertCache(bank, capacity, "cpu", fill_fraction=fill_fraction, **cache))
    ctl.set_behind(safety)
    return bank, ctl


@pytest.mark.parametrize("admit", [0, LAYERS], ids=["lru", "admission"])
def test_plan_matches_its_reference_and_an_expert_is_resident_only_once_all_its_words_are_in(admit):
    """Over 48 layer calls (12 experts, 10 slots, q* 0.3): the plan kernel leaves the state,
    residency and clocks exactly as the reference; copies start, take several calls, stage the
    bank's words, and an expert becomes resident only once every word is in, in a slot then
    holding its bank rows. With fill admission (the engine's window: a step's calls) it takes
    only a slot idle that long, as the control step's fills do."""
    bank, ctl = _control(10, admit_window=admit)
    assert ctl.window == admit
    g = torch.Generator().manual_seed(1)
    cpu_time = ctl.behind.cpu_time.tolist()
    flat13, flat2 = bank.w13.view(-1, 2 * 8, H), bank.w2.view(-1, H, 8)
    started = sliced_calls = 0
    for step in range(16):
        for layer in range(LAYERS):
            ids = _routing(g, tokens=1 + step % 2, hot=9)
            out = ctl.step(layer, ids, copy=False)
            want = _snapshot(ctl)
            _plan_reference(want, layer, out.step_counts.tolist(), out.cpu_exp.tolist(), cpu_time, 0.8, ctl.window)
            prev = ctl.behind.state.tolist()
            ctl.copy(layer, out)
            got = _snapshot(ctl)
            assert got == {**want, "clock": got["clock"]}, (step, layer)
            owner, slot, lo, hi, _, _, fin = got["state"]
            started += owner >= 0 and owner != prev[0]
            if fin:                                           # completed: resident, with its bank rows
                assert prev[3] == WORDS and ctl.slot_of.view(-1)[prev[0]] == slot
                assert torch.equal(ctl.w13_slots[slot], flat13[prev[0]])
                assert torch.equal(ctl.w2_slots[slot], flat2[prev[0]])
            if owner >= 0:
                sliced_calls += hi > lo
                assert ctl.slot_of.view(-1)[owner] < 0                          # not resident yet
                assert torch.equal(_words(*ctl.behind.staging)[:hi], _words(flat13[owner], flat2[owner])[:hi])
    counted = ctl.behind.counters()
    assert started >= 3 and counted["made_resident"] >= 2 and sliced_calls > started    # copies span calls
    live = ctl.slot_owner >= 0
    assert torch.equal(ctl.w13_slots[:10][live], flat13[ctl.slot_owner[live]])
    assert torch.equal(ctl.w2_slots[:10][live], flat2[ctl.slot_owner[live]])


def _run(ctl, bank, g, steps: int, hot: int) -> list[int]:
    """Decode calls whose pairs on slots are computed from the pool and compared bit for bit with
    the same kernel over the bank's own weights (a CPU pair's row is the bank's by construction);
    returns the CPU pairs per step."""
    cpu = []
    for step in range(steps):
        n = 0
        for layer in range(LAYERS):
            x = torch.randn(1, H, generator=g).to(torch.bfloat16)
            ids = _routing(g, 1, hot)
            out = ctl.step(layer, ids)
            tok = torch.zeros(K, dtype=torch.int64)
            on = out.pair_slot >= 0
            rows = moe_slots_forward(x, ctl.w13_slots, ctl.w2_slots, tok, out.pair_slot)
            assert torch.equal(rows[on], moe_slots_forward(x, bank.w13[layer], bank.w2[layer], tok[on],
                                                           ids.reshape(-1)[on])), (step, layer)
            n += int((~on).sum())
        cpu.append(n)
    return cpu


def test_outputs_are_unchanged_and_recurring_experts_stop_going_to_the_cpu():
    """Batch 1 over a routing that keeps coming back to 5 experts a layer, 16 slots, q* 0.1 (a
    slow link: q* fills nothing of 4 misses): every pair computed from the pool equals the same
    computation on the bank's weights bit for bit (a half-copied slot is never read), and the
    idle PCIe time brings the recurring experts in, which the q* rule alone never does."""
    runs = {}
    for safety in (None, 1.0):
        bank, ctl = _control(16, fill_fraction=0.1, safety=safety, seed=2)
        runs[safety] = _run(ctl, bank, torch.Generator().manual_seed(4), steps=24, hot=5)
    assert min(runs[None]) == 3 * K                           # every pair on the CPU, every step
    assert sum(runs[1.0][12:]) < sum(runs[None][12:]) / 2, runs


def _checked_write_back(ctl, cache) -> None:
    """Hand the control's residency and pool to the host cache and check its books and bytes."""
    ctl.write_back(cache)
    cache.w13.copy_(ctl.w13_slots[:10])
    cache.w2.copy_(ctl.w2_slots[:10])
    cache.check_integrity(deep=True)


def test_a_copy_in_flight_holds_no_slot_so_write_backs_and_seeds_see_a_sound_cache():
    """A copy crossing PCIe holds no slot: a write-back to the host cache mid-copy leaves a cache
    whose books and every resident slot's bytes check out, a seed runs as usual, and copies then
    go on completing. A prefetch refuses to run beside fills behind the CPU."""
    bank, ctl = _control(10)
    cache = ExpertCache(bank, 10, "cpu", fill_fraction=0.3)
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        ctl.step(0, _routing(g, 2, 9))
        if ctl.behind.counters()["owner"] >= 0:
            break
    assert ctl.behind.counters()["owner"] >= 0
    _checked_write_back(ctl, cache)
    ctl.seed(1, _routing(g, 1, 12), bank.w13[1], bank.w2[1])
    made = ctl.behind.counters()["made_resident"]
    for _ in range(40):
        ctl.step(0, _routing(g, 2, 9))
    assert ctl.behind.counters()["made_resident"] > made
    _checked_write_back(ctl, cache)
    with pytest.raises(ValueError, match="prefetch"):
        ctl.prefetch(1, _routing(g, 1, 12))
    ctl.set_behind(None)
    assert ctl.behind is None


def test_all_resident_pauses_the_copy_and_restores_it():
    """A graph warm-up's steps (``all_resident``) complete no copy (its staged expert would land
    in a real slot) and leave the copy in flight as it was."""
    bank, ctl = _control(10)
    g = torch.Generator().manual_seed(1)
    while ctl.behind.counters()["owner"] < 0:
        ctl.step(0, _routing(g, 2, 9))
    before = ctl.behind.state.clone(), ctl.last_used.clone(), ctl.w13_slots.clone()
    with ctl.all_resident():
        assert ctl.behind.counters()["owner"] == -1
        for layer in range(LAYERS):
            ctl.step(layer, _routing(g, 2, 12))
        assert ctl.behind.state[FINALIZE] == 0
    assert torch.equal(ctl.behind.state, before[0]) and torch.equal(ctl.last_used, before[1])
    # compared as bytes: rows never filled hold whatever memory held, NaNs included
    assert torch.equal(ctl.w13_slots.view(torch.int16), before[2].view(torch.int16))


def test_a_control_with_fills_behind_is_freed_with_its_last_reference():
    """No reference cycle keeps a dropped control's pool alive until a garbage collection (on a
    GPU the pool is gigabytes: the MoE bench's next row ran out of memory when one did)."""
    import gc
    import weakref
    _, ctl = _control(10)
    ctl.step(0, _routing(torch.Generator().manual_seed(1), 2, 9))
    gone = weakref.ref(ctl)
    gc.disable()
    try:
        del ctl
        assert gone() is None
    finally:
        gc.enable()


def test_cpu_time_table_and_settings_are_checked():
    """The budget's CPU time follows the q* rule's cost (n f / (1 - f) / speed(n)); bad settings
    are refused with a clear error."""
    t = cpu_time_table(0.5, 4, torch.device("cpu"), (1.0, 2.0)).tolist()
    assert t == [0.0, 1.0, 1.0, 1.5, 2.0]
    assert cpu_time_table(1.0, 3, torch.device("cpu")).tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="fill_fraction"):
        cpu_time_table(1.5, 3, torch.device("cpu"))
    _, ctl = _control(10)
    with pytest.raises(ValueError, match="safety"):
        ctl.set_behind(0.0)


def test_the_engine_with_fills_behind_the_cpu_gives_the_same_tokens(tiny_checkpoint, monkeypatch):
    """FREETOKEN_FILL_BEHIND=on in the engine's Triton path (12 of 16 experts cached, q* 0.2, so the CPU
    takes most misses and PCIe idles): the tokens are the torch path's before and after a resize,
    experts were made resident behind the CPU, and the host cache's books balance after a
    write-back. The switch is refused beside the expert prefetch, and any value but on / off."""
    from freetoken_engine import LLM, SamplingParams, env
    prompt, greedy = [5, 17, 99, 200, 3, 44, 12, 300], SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    folder = tiny_checkpoint("qwen3_moe")
    want = LLM(folder, expert_backend="torch").generate(prompt, greedy).token_ids
    monkeypatch.setenv("FREETOKEN_FILL_BEHIND", "on")
    llm = LLM(folder, expert_backend="triton", expert_cache_experts=12, cpu_expert_fraction=0.8)
    assert llm.generate(prompt, greedy).token_ids == want
    made = llm.runner.experts.control.behind.counters()["made_resident"]
    assert made > 0
    llm.runner.resize_expert_cache(8)
    assert llm.generate(prompt, greedy).token_ids == want
    llm.runner.experts.sync_stats()
    llm.runner.cache.check_integrity(deep=True)
    monkeypatch.setenv("FREETOKEN_EXPERT_PREFETCH", "on")
    with pytest.raises(ValueError, match="cannot run beside FREETOKEN_EXPERT_PREFETCH"):
        env.validate()
    monkeypatch.setenv("FREETOKEN_EXPERT_PREFETCH", "off")
    monkeypatch.setenv("FREETOKEN_FILL_BEHIND", "yes")
    with pytest.raises(ValueError, match="FREETOKEN_FILL_BEHIND must be on or off"):
        env.validate()
