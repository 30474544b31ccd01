"""Decode's CPU branch captured in a CUDA graph (``pytest -m gpu tests/gpu``): the device's
control step, its host mirrors and the handshake flags in pinned memory, answered by the C++ host
loop while the graph runs. The rows the device receives must be exactly the CPU kernel's for the
pairs the control step left to the CPU, step after step (a missing fence or a stale read shows
up as a wrong or old row)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from branch_steps import graph_replays, random_bank
from freetoken_engine.cache.bank import ExpertBank
from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.cache.experts import ExpertCache
from freetoken_engine.kernels import cpu_experts
from freetoken_engine.kernels.cpu_branch import CpuBranch
from freetoken_engine.kernels.triton import handshake

CUDA = torch.device("cuda")
LAYERS, EXPERTS, H, I, K, T = 6, 32, 512, 256, 8, 2


def test_graph_step_receives_the_cpu_kernels_rows():
    bank = random_bank(LAYERS, EXPERTS, H, I, torch.bfloat16, seed=0, scale=0.05)
    bank.pin()
    cache = ExpertCache(bank, 40, CUDA, fill_fraction=0.5)
    ctl = DeviceControl.from_cache(cache)
    br = CpuBranch(bank.w13, bank.w2, T, K, CUDA)
    counts = torch.zeros(LAYERS, 4, dtype=torch.int64).pin_memory()
    ids = torch.zeros(LAYERS, T, K, dtype=torch.int64, device=CUDA)
    x = torch.zeros(LAYERS, T, H, dtype=torch.bfloat16, device=CUDA)
    got = torch.zeros(LAYERS, T * K, H, dtype=torch.bfloat16, device=CUDA)

    def step():
        handshake.bump(br.epoch)
        for l in range(LAYERS):
            ctl.step(l, ids[l], mirror=(br.pair_slot[l], counts[l], br.pair_exp[l]))
            handshake.signal(br.flag[l:l + 1], br.epoch, src=x[l], dst=br.x[l])
            handshake.wait(br.done[l:l + 1], br.epoch, br.err)
            got[l].copy_(br.rows, non_blocking=True)

    def new_inputs(seed: int):
        gen = torch.Generator().manual_seed(seed)
        ids.copy_(torch.stack([torch.stack([torch.randperm(EXPERTS, generator=gen)[:K] for _ in range(T)])
                               for _ in range(LAYERS)]))
        x.copy_(torch.randn(LAYERS, T, H, generator=gen).to(torch.bfloat16))

    cpu_pairs = 0
    for seed in graph_replays(br, step, new_inputs, range(1, 6)):
        tok = torch.arange(T).repeat_interleave(K)
        for l in range(LAYERS):
            cpu = br.pair_slot[l] < 0
            n = int(cpu.sum())
            exp = ids[l].cpu().reshape(-1)[cpu]
            want = cpu_experts.experts_forward(x[l].cpu(), bank.w13[l], bank.w2[l], tok[cpu], exp)
            assert torch.equal(got[l, :n].cpu(), want), (seed, l)
            cpu_pairs += n
    assert cpu_pairs > 0 and br.host_epoch == int(br.epoch) == 6
    torch.cuda.synchronize()
    bank.unpin()


def test_device_wait_gives_up_after_its_timeout():
    """No host answers: the device's wait must end after its timeout (the GPU clock) and flag
    the step, not hang the stream."""
    import time
    bank = ExpertBank(1, 4, 64, 32, torch.bfloat16)
    br = CpuBranch(bank.w13, bank.w2, 1, 2, CUDA)
    handshake.bump(br.epoch)
    t0 = time.perf_counter()
    handshake.wait(br.done[0:1], br.epoch, br.err, timeout_s=0.2)
    torch.cuda.synchronize()
    assert 0.2 <= time.perf_counter() - t0 < 30
    with pytest.raises(RuntimeError, match="stopped waiting for the host in step 1"):
        br.check()
