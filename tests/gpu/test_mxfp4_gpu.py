"""Experts kept in MXFP4 on a real GPU (``pytest -m gpu tests/gpu``): the compiled Triton kernels
on 4-bit slots give what they give on the same values stored densely (the decoded weights are
exact in bf16 and enter the same products, maybe summed in another order), in gpt-oss-20b's
expert shape; and the
engine on a published-form gpt-oss checkpoint keeps its experts in 4 bits on the GPU with the
tokens of the dense engine, through the cache, the fills and the CPU branch."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))   # test_gpt_oss's checkpoint

from freetoken_engine import LLM, SamplingParams  # noqa: E402
from freetoken_engine.kernels import mxfp4  # noqa: E402
from freetoken_engine.kernels.triton.moe import moe_slots_forward  # noqa: E402

CUDA = torch.device("cuda")
H = I = 2880                     # gpt-oss-20b's expert shape
PROMPT = [5, 17, 99, 200, 3, 44, 12, 300, 8, 9, 77, 150]


# the lanes kernels, grouping in the kernel, the block table, the dense scratch's rounds (200 pairs a slot)
@pytest.mark.parametrize("tokens,rounds", [(1, False), (4, False), (300, False), (300, True)])
def test_mxfp4_slots_match_their_dense_values(monkeypatch, tokens, rounds):
    """The same products as on the dense values; the compiled kernels may sum them in another
    order (their register layouts differ: measured on the H200, a one-token call differs in the
    last bits, a 300-token one not at all), so within bf16's rounding of the output."""
    from freetoken_engine.kernels.triton import moe_mx_dense
    monkeypatch.setattr(moe_mx_dense, "MX_DENSE_PAIRS", 1 if rounds else None)
    monkeypatch.setattr(moe_mx_dense, "MX_SCRATCH_BYTES", 4 * 3 * H * I * 2)     # 4 of the 6 slots a round
    g = torch.Generator().manual_seed(0)
    q13 = torch.randint(0, 256, (6, 2 * I, mxfp4.row_bytes(H)), dtype=torch.uint8, generator=g)
    q2 = torch.randint(0, 256, (6, H, mxfp4.row_bytes(I)), dtype=torch.uint8, generator=g)
    q13[..., H // 2:], q2[..., I // 2:] = 120, 121                      # scales: values within bf16 easily
    d13, d2 = mxfp4.dequantize(q13, torch.bfloat16), mxfp4.dequantize(q2, torch.bfloat16)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    k = min(4, 6)
    tok = torch.arange(tokens).repeat_interleave(k)
    slot = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(tokens)]).flatten()
    args = [t.to(CUDA) for t in (tok, slot)]
    four = moe_slots_forward(x.to(CUDA), q13.to(CUDA), q2.to(CUDA), *args)
    dense = moe_slots_forward(x.to(CUDA), d13.to(CUDA), d2.to(CUDA), *args)
    assert (four.float() - dense.float()).abs().max() <= 2.0 ** -7 * dense.float().abs().max()


@pytest.mark.parametrize("tokens", [1, 3])
def test_every_code_and_scale_compiled(tokens):
    """Compiled, in float32: the one-token and tiled kernels on every code in every block and
    scales from 2^-127 (a float32 subnormal: no flush to zero) to 2^12, within 1e-5 of the
    reference's output scale (the interpreter's test in tests/engine/test_triton_mxfp4.py)."""
    from freetoken_engine.kernels.reference import expert_pairs_forward
    g = torch.Generator().manual_seed(5)
    q13, q2 = mxfp4.random_rows((5, 2 * I), H, g, (100, 140)), mxfp4.random_rows((5, H), I, g, (110, 130))
    q13[:, :, :H // 2] = (torch.arange(H // 2) * 17 % 256).to(torch.uint8)
    q13[1, :, H // 2], q2[2, :, I // 2 + 1] = 0, 0
    x = torch.randn(tokens, H, generator=g)
    tok = torch.arange(tokens).repeat_interleave(4)
    slot = torch.cat([torch.tensor([1, 3, -1, 2]).roll(t) for t in range(tokens)])
    out = moe_slots_forward(x.to(CUDA), q13.to(CUDA), q2.to(CUDA), tok.to(CUDA), slot.to(CUDA)).cpu()
    ref = expert_pairs_forward(x, mxfp4.dequantize(q13, torch.float32), mxfp4.dequantize(q2, torch.float32),
                               tok[slot >= 0], slot[slot >= 0])
    assert (out[slot >= 0] - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt_oss_in_four_bits_on_the_gpu_keeps_the_dense_tokens(tiny_checkpoint, tmp_path, dtype):
    """Every expert resident: the same kernels on the same values, so the dense engine's tokens
    in both dtypes. With misses filled or computed on the host (float32 only: the CPU's 4-bit
    kernel sums in another order than its dense one, within fp32 rounding): the same tokens too."""
    from test_gpt_oss import _as_mxfp4
    src = tiny_checkpoint("gpt_oss", hidden_size=64, intermediate_size=64, head_dim=16)
    mx, _ = _as_mxfp4(src, tmp_path)
    greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    cases = [(None, None)] + ([(1, 0.0), (3, 0.5), (5, 1.0)] if dtype == "float32" else [])
    for capacity, fraction in cases:
        opts = {} if capacity is None else dict(expert_cache_experts=capacity, cpu_expert_fraction=fraction)
        four = LLM(mx, device="cuda", dtype=dtype, expert_format="mxfp4", **opts)
        dense = LLM(mx, device="cuda", dtype=dtype, expert_format="dense", **opts)
        assert four.runner.bank.mxfp4 and four.runner.cache.w13.dtype == torch.uint8
        for prompt in (PROMPT, PROMPT * 8):         # decode calls; whole-layer prefill calls
            got = four.generate(prompt, greedy)
            assert got.token_ids == dense.generate(prompt, greedy).token_ids, (capacity, fraction)
        if fraction:
            assert four.runner.experts.host_branch.br.totals["cpu_pairs"] > 0


def test_a_four_bit_packed_folder_runs_dense_on_a_gpu_that_holds_it_all(tiny_checkpoint, tmp_path, monkeypatch):
    """``auto`` on a GPU whose free memory holds every expert dense dequantizes a packed folder's
    4-bit bank as it reads it (all resident, the dense kernels are the fast ones): the source's dense
    tokens; with less free memory (mem_get_info's answer shrunk) ``auto`` would keep 4 bits, which
    give the same tokens."""
    from test_gpt_oss import _as_mxfp4

    from freetoken_engine.packed import convert
    src = tiny_checkpoint("gpt_oss", hidden_size=64, intermediate_size=64, head_dim=16)
    mx, _ = _as_mxfp4(src, tmp_path)
    packed = convert(mx, tmp_path / "p4", progress=False)
    greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    llm = LLM(packed, device="cuda", dtype="float32")
    assert not llm.runner.bank.mxfp4 and llm.runner.bank.pinned
    want = LLM(mx, device="cuda", dtype="float32").generate(PROMPT, greedy).token_ids
    assert llm.generate(PROMPT, greedy).token_ids == want
    from freetoken_engine.models import build
    real = torch.cuda.mem_get_info
    small = llm.runner.bank.expert_bytes * llm.runner.bank.total_experts        # the dense bank's bytes
    monkeypatch.setattr(build.torch.cuda, "mem_get_info", lambda d=None: (small, real(d)[1]))
    assert build.auto_dense(llm.runner.mcfg, torch.float32, CUDA) is False
    monkeypatch.undo()
    four = LLM(packed, device="cuda", dtype="float32", expert_format="mxfp4")
    assert four.runner.bank.mxfp4 and four.generate(PROMPT, greedy).token_ids == want
