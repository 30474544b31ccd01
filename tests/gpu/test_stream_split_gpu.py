"""The streamed split on a GPU inside a CUDA graph (``pytest -m gpu tests/gpu``): the control step
chooses the streamed rows, the first rows of the CPU experts cross PCIe into scratch slots and
are computed by the Triton kernel while the C++ host loop computes the rest; every pair's sum
must match the whole expert (bf16: within the two roundings of the two partial rows)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from branch_steps import graph_replays, random_bank
from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.cache.experts import ExpertCache
from freetoken_engine.kernels import reference
from freetoken_engine.kernels.cpu_branch import CpuBranch
from freetoken_engine.kernels.triton import handshake
from freetoken_engine.kernels.triton.moe import moe_slots_forward

CUDA = torch.device("cuda")
LAYERS, EXPERTS, H, I, K, T = 6, 32, 512, 256, 8, 1


@pytest.mark.parametrize("mode", ["rows", "rows-floor", "stage"])
def test_graph_step_with_streamed_rows_matches_the_experts(mode):
    """Also the split by stage: the whole W2 of some CPU experts copied, their down projection on
    the GPU from the host's activations (after the graph's wait on the act flag)."""
    bank = random_bank(LAYERS, EXPERTS, H, I, torch.bfloat16, seed=1, scale=0.05)
    bank.pin()
    cache = ExpertCache(bank, 150, CUDA, fill_fraction=0.3)
    ctl = DeviceControl.from_cache(cache)
    ctl.set_stream(8, 64, floor_fills=mode == "rows-floor", stage=mode == "stage")
    br = CpuBranch(bank.w13, bank.w2, T, K, CUDA)
    counts = torch.zeros(LAYERS, 4, dtype=torch.int64).pin_memory()
    ids = torch.zeros(LAYERS, T, K, dtype=torch.int64, device=CUDA)
    x = torch.zeros(LAYERS, T, H, dtype=torch.bfloat16, device=CUDA)
    got = torch.zeros(LAYERS, T * K, H, dtype=torch.bfloat16, device=CUDA)
    tok = torch.arange(T, device=CUDA).repeat_interleave(K)
    host_rows = torch.zeros(T * K, H, dtype=torch.bfloat16, device=CUDA)

    def step():
        handshake.bump(br.epoch)
        for l in range(LAYERS):
            out = ctl.step(l, ids[l], copy=False,
                           mirror=(br.pair_slot[l], counts[l], br.pair_exp[l], br.from_rows[l:l + 1]))
            handshake.signal(br.flag[l:l + 1], br.epoch, src=x[l], dst=br.x[l])
            ctl.copy(l, out)
            gpu = moe_slots_forward(x[l], cache.w13, cache.w2, tok, out.pair_slot)
            part = ctl.streamed_forward(x[l], tok, out)
            if mode == "stage":
                handshake.wait(br.act_flag[l:l + 1], br.epoch, br.err)
                part = ctl.stage_forward(br.act, out)
            handshake.wait(br.done[l:l + 1], br.epoch, br.err)
            host_rows.copy_(br.rows, non_blocking=True)
            cpu = out.pair_slot < 0
            rank = (torch.cumsum(cpu, 0) - 1).clamp_min(0)
            got[l].copy_(torch.where(cpu[:, None], host_rows[rank] + part, gpu))

    def new_inputs(seed: int):
        gen = torch.Generator().manual_seed(seed)
        # 12 hot experts per layer: the cache holds most, so a layer misses one to three
        ids.copy_(torch.stack([torch.stack([torch.randperm(12, generator=gen)[:K] for _ in range(T)])
                               for _ in range(LAYERS)]))
        x.copy_(torch.randn(LAYERS, T, H, generator=gen).to(torch.bfloat16))

    streamed_pairs = 0
    for _ in graph_replays(br, step, new_inputs, range(1, 8)):
        for l in range(LAYERS):
            want = reference.expert_pairs_forward(x[l].cpu().float(), bank.w13[l].float(), bank.w2[l].float(),
                                                  tok.cpu(), ids[l].cpu().reshape(-1))
            torch.testing.assert_close(got[l].cpu().float(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))
            streamed_pairs += int((br.pair_slot[l, :T * K] == (-3 if mode == "stage" else -2)).sum())
    assert streamed_pairs > 0 and br.totals["stage_pairs" if mode == "stage" else "streamed_rows"] > 0
