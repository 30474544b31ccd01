"""Decode's CPU branch as a handshake between device kernels and a C++ host loop
(``kernels/cpu_branch.py``): on the CPU the Triton kernels run under TRITON_INTERPRET=1 in this
thread while ``CpuBranch.run`` answers from another, as the host does next to a GPU graph. The
rows must be exactly the expert kernel's, wherever each pair was computed, and neither side may
hang when the other is gone."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import pytest  # noqa: E402
import torch  # noqa: E402

from branch_steps import HostThread, random_bank
from freetoken_engine.cache.bank import ExpertBank
from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.cache.experts import ExpertCache
from freetoken_engine.kernels import cpu_experts
from freetoken_engine.kernels.cpu_branch import CpuBranch
from freetoken_engine.kernels.triton import handshake

if not cpu_experts.available():
    pytest.skip("the compiled CPU kernel is not available (no C++ compiler)", allow_module_level=True)

LAYERS, EXPERTS, H, I, K, T = 3, 12, 64, 32, 4, 2


def _bank(dtype=torch.bfloat16) -> ExpertBank:
    return random_bank(LAYERS, EXPERTS, H, I, dtype, seed=3, scale=0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_step_rows_equal_the_expert_kernel_wherever_computed(dtype):
    bank = _bank(dtype)
    cache = ExpertCache(bank, 6, "cpu", fill_fraction=0.5)     # a small pool: misses go both ways
    ctl = DeviceControl.from_cache(cache)
    br = CpuBranch(bank.w13, bank.w2, T, K, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    cpu_pairs = 0
    for step in range(4):
        t = 1 + step % T                                          # steps of 1..T tokens
        tok = torch.arange(t).repeat_interleave(K)
        counts = torch.zeros(LAYERS, 4, dtype=torch.int64)
        host = HostThread(br, tokens=t)
        handshake.bump(br.epoch)
        for l in range(LAYERS):
            x = (torch.randn(t, H, generator=g)).to(dtype)
            ids = torch.stack([torch.randperm(8, generator=g)[:K] for _ in range(t)])
            out = ctl.step(l, ids, mirror=(br.pair_slot[l, :t * K], counts[l], br.pair_exp[l, :t * K]))
            handshake.signal(br.flag[l:l + 1], br.epoch, src=x, dst=br.x[l, :t])
            dev = out.pair_slot >= 0
            got = torch.empty(t * K, H, dtype=dtype)
            got[dev] = cpu_experts.experts_forward(x, cache.w13, cache.w2, tok[dev], out.pair_slot[dev])
            handshake.wait(br.done[l:l + 1], br.epoch, br.err)
            got[~dev] = br.rows[:int((~dev).sum())]
            want = cpu_experts.experts_forward(x, bank.w13[l], bank.w2[l], tok, ids.reshape(-1))
            assert torch.equal(got, want), (step, l)
            cpu_pairs += int((~dev).sum())
        host.join()
    br.check()
    assert cpu_pairs > 0 and br.totals["cpu_pairs"] == cpu_pairs and br.totals["steps"] == 4
    assert int(br.epoch) == br.host_epoch == 4


def test_host_gives_up_on_a_silent_device_with_a_clear_error():
    bank = _bank()
    br = CpuBranch(bank.w13, bank.w2, T, K, torch.device("cpu"), timeout_s=0.05)
    with pytest.raises(RuntimeError, match="did not publish layer 0 of step 1 within 0.05 s"):
        br.run()


def test_device_wait_gives_up_and_flags_the_step():
    bank = _bank()
    br = CpuBranch(bank.w13, bank.w2, T, K, torch.device("cpu"))
    handshake.bump(br.epoch)
    handshake.wait(br.done[0:1], br.epoch, br.err, max_spins=3)       # no host answers
    with pytest.raises(RuntimeError, match="stopped waiting for the host in step 1"):
        br.check()


def test_bad_arguments_are_refused():
    bank = _bank()
    with pytest.raises(ValueError, match="must be bf16 or fp32"):
        CpuBranch(bank.w13.half(), bank.w2.half(), T, K, torch.device("cpu"))
    with pytest.raises(ValueError, match="at most 1024 pairs"):
        CpuBranch(bank.w13, bank.w2, 200, 8, torch.device("cpu"))
    br = CpuBranch(bank.w13, bank.w2, T, K, torch.device("cpu"))
    with pytest.raises(ValueError, match="one int64 element"):
        handshake.signal(br.flag, br.epoch)


def test_an_abandoned_step_is_cancelled_not_waited_for():
    """A step whose caller stopped after layer 0 (an exception between layers) must end at once
    when cancelled, not after the host loop's timeout, and leave the next step working."""
    from freetoken_engine.kernels.cpu_branch import StepCancelled
    bank = _bank()
    br = CpuBranch(bank.w13, bank.w2, T, K, torch.device("cpu"), timeout_s=60.0)
    host = HostThread(br)
    handshake.bump(br.epoch)
    br.pair_slot[0].fill_(0)                          # layer 0: nothing for the CPU
    handshake.signal(br.flag[0:1], br.epoch)
    handshake.wait(br.done[0:1], br.epoch, br.err)    # answered; then the caller gives up
    br.cancel()
    with pytest.raises(StepCancelled, match="step 1 cancelled at layer 1"):
        host.join()
    host = HostThread(br)                                  # the next step runs normally
    handshake.bump(br.epoch)
    for l in range(LAYERS):
        br.pair_slot[l].fill_(0)
        handshake.signal(br.flag[l:l + 1], br.epoch)
        handshake.wait(br.done[l:l + 1], br.epoch, br.err)
    host.join()
    br.check()


def test_engine_step_abandoned_after_one_layer_is_cancelled_at_the_next():
    """cache/host_branch.py: a decode step that raised after its first MoE layer must not leave
    the host loop waiting (the next step would stall for its timeout); the next step is exact."""
    import time

    from freetoken_engine.cache.host_branch import HostBranch
    bank = _bank()
    cache = ExpertCache(bank, 6, "cpu", fill_fraction=0.5)
    ctl = DeviceControl.from_cache(cache)
    hb = HostBranch(bank, K, T, torch.device("cpu"), torch.bfloat16, timeout_s=60.0)
    g = torch.Generator().manual_seed(9)
    tok = torch.arange(T).repeat_interleave(K)

    def layer(l):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(8, generator=g)[:K] for _ in range(T)])
        got = hb.layer(ctl, l, x, ids, tok)[0].dense()
        return got, cpu_experts.experts_forward(x, bank.w13[l], bank.w2[l], tok, ids.reshape(-1))

    layer(0)                                    # then the step is abandoned
    t0 = time.perf_counter()
    for l in range(LAYERS):                     # the next step starts by finishing the last one
        got, want = layer(l)
        assert torch.allclose(got.float(), want.float(), atol=2e-2 * want.abs().max().item()), l
    hb.finish()
    assert time.perf_counter() - t0 < 30
    hb.close()
