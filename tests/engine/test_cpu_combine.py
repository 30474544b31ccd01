"""The MoE combine as one compiled call on the CPU (kernels/cpu/combine.py): an MoE layer's
output from its pair rows, bit for bit what torch's ops (reference.moe_combine_forward) give,
for any number of tokens (more than a few run on the kernel's threads), with and without a
shared expert's rows and the residual; what the kernel does not take goes to torch; the engine's
prompts give the same logits through it."""
from __future__ import annotations

import pytest
import torch

from freetoken_engine import LLM
from freetoken_engine.kernels import cpu_experts, reference
from freetoken_engine.kernels.cpu import combine
from freetoken_engine.layers import moe
from test_parity import PROMPT

pytestmark = pytest.mark.skipif(not cpu_experts.available(), reason="no C++ compiler: torch's ops run")


def inputs(T: int, k: int, H: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(T * k, H, generator=g).to(dtype)
    weights = torch.rand(T, k, generator=g).to(dtype)
    return rows, weights, torch.randn(T, H, generator=g).to(dtype), torch.randn(T, H, generator=g).to(dtype)


@pytest.fixture
def no_fallback(monkeypatch):
    """torch's combine made to fail: a call that reached it did not run compiled."""
    def refuse(*args):
        raise AssertionError("the combine fell back to torch's ops")
    monkeypatch.setattr(combine, "moe_combine_forward", refuse)


@pytest.mark.parametrize("dtype,T,k,H", [(dt, *shape) for dt in (torch.float32, torch.bfloat16)
                                         for shape in ((1, 8, 64), (5, 15, 576), (300, 8, 1024), (64, 1, 320))]
                         + [(torch.bfloat16, 300, 8, 1000), (torch.bfloat16, 9, 4, 72)])
def test_the_compiled_combine_equals_torchs_bit_for_bit(no_fallback, dtype, T, k, H):
    """300 tokens: the kernel's threads; 1,000 columns: four blocks of 256 and a short one."""
    rows, weights, shared, residual = inputs(T, k, H, dtype)
    for s in (None, shared):
        for r in (None, residual):
            want = reference.moe_combine_forward(rows, weights, s, r)
            got = combine.moe_combine(rows, weights, s, r)
            assert got.dtype == dtype and got.shape == (T, H)
            assert torch.equal(got, want), f"shared {s is not None}, residual {r is not None}"


@pytest.mark.parametrize("case", ["float16", "strided rows", "weights of another dtype", "split rows",
                                  "float32 of 1,000 columns"])
def test_what_the_kernel_does_not_take_gets_torchs_result(case):
    """float32 rows of a width that is not a multiple of 64: torch sums their last columns in
    another order (see the module), so they go to torch, bit for bit its result."""
    H = 1000 if case.endswith("columns") else 128
    rows, weights, shared, residual = inputs(6, 4, H, torch.float16 if case == "float16" else torch.float32)
    if case == "strided rows":
        rows = torch.cat((rows, rows), dim=1)[:, ::2]
    elif case == "weights of another dtype":
        weights = weights.double()
    elif case == "split rows":
        rows = reference.SplitRows(rows, torch.full((rows.shape[0],), -1), rows.clone())
    want = reference.moe_combine_forward(rows, weights, shared, residual)
    assert torch.equal(combine.moe_combine(rows, weights, shared, residual), want)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompts_logits_are_the_same_through_the_compiled_combine(tiny_checkpoint, monkeypatch, model_type, dtype):
    """qwen2_moe: a gated shared expert; gpt-oss: the experts' output biases beside the rows."""
    llm = LLM(tiny_checkpoint(model_type), dtype=dtype)
    prompt = PROMPT * 4                                  # a pass of more than 8 rows: the modules run
    calls = []
    compiled = combine.moe_combine

    def counted(*args):
        calls.append(args[0].shape[0])
        return compiled(*args)
    monkeypatch.setattr(moe, "moe_combine", counted)
    got = llm.prefill_logits(prompt)
    assert calls and max(calls) > 8
    monkeypatch.setattr(moe, "moe_combine", reference.moe_combine_forward)
    assert torch.equal(got, llm.prefill_logits(prompt))
