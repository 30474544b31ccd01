"""Cross-layer prefetch in the device control step (``DeviceControl.prefetch``, its state in
``cache/guess.py``), under TRITON_INTERPRET=1 on the CPU: a prefetch makes the residency the
guessed layer's step would and changes nothing else, the step counts its fills against its own
share, and after prefetches of wrong guesses every pair still reads its own expert."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import pytest  # noqa: E402
import torch  # noqa: E402

from freetoken_engine.cache.device_control import DeviceControl  # noqa: E402
from freetoken_engine.cache.experts import ExpertCache  # noqa: E402
from freetoken_engine.kernels.triton.control import control_step  # noqa: E402
from freetoken_engine.kernels.triton.control_outputs import ControlOutputs  # noqa: E402

from control_cases import EXPERTS, K, LAYERS, bank, warm_controls  # noqa: E402


def test_a_prefetch_changes_residency_as_the_step_would_and_nothing_else():
    """``prefetch(layer, guess)``: the fills, victims and slot contents the layer's step on those
    ids would make, stamped with that step's clock, but the clock, the counters and the routing
    history stay; the counts go to the prefetch counters. The real step on the same ids then
    finds every filled guess resident, and a prefetch never evicts a slot the step before used."""
    ahead, plain = warm_controls(bank(), 5, 2)
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
    filled = ahead.guessed.outputs_by_pairs[2 * K].fill_exp[ahead.guessed.outputs_by_pairs[2 * K].fill_exp >= 0]
    out = ahead.step(1, guess)
    assert bool((ahead.slot_of[1, filled] >= 0).all()) and out.step_counts[1] == pf["misses"] - pf["fills"]
    with pytest.raises(ValueError, match="prefetch step needs admit_window"):
        control_step(1, guess, ahead.slot_of, ahead.slot_owner, ahead.last_used, ahead.clock, ahead.fill_table,
                     ahead.guessed.totals, ControlOutputs.allocate(2 * K, EXPERTS, 7, torch.device("cpu")),
                     admit_window=0, prefetch=True)


def test_a_prefetch_and_its_step_fill_what_the_step_alone_would():
    """The guessed layer's step counts the prefetch's fills against its PCIe share: with right
    guesses, the prefetch and the step together fill, and leave to the CPU, exactly what the step
    alone fills and leaves; with guesses that were all resident (the call's hits: no prefetch
    fill) the step keeps its whole share (a rule of "fill nothing after a prefetch" halved the
    H200 engine's speed with a predictor like that: its guesses hit, and every miss went to the
    CPU)."""
    ids = torch.tensor([[9, 10, 11, 0], [1, 9, 10, 2]])
    alone, right, resident = warm_controls(bank(4), 2, 3)
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
    experts_bank = bank(3, experts)
    g = torch.Generator().manual_seed(11)
    ctl = DeviceControl.from_cache(ExpertCache(experts_bank, 3 * K, "cpu", fill_fraction=fraction, admit_window=1))
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
            assert torch.equal(ctl.w13_slots[ps[p]], experts_bank.w13[layer, int(ids.reshape(-1)[p])])
        filled += int(out.step_counts[2])
    assert filled > 0 and ctl.prefetch_counters()["fills"] > 0
