"""The one-launch biased router (``kernels/triton/route.route_biased``) against the torch
reference (``layers/moe.biased_route``) for GLM-4.5's and ERNIE-4.5's routing and DeepSeek-V3's
and V2's groups: the same experts and weights to float32 rounding, NaN logits kept inside the experts.
Under TRITON_INTERPRET=1 on CPU tensors in CI; compiled on the H200 in the GPU test below."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from freetoken_engine.config import MoeConfig  # noqa: E402
from freetoken_engine.kernels.triton.route import route_biased, supported_biased  # noqa: E402
from freetoken_engine.layers.moe import biased_route  # noqa: E402

COMPILED = os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if COMPILED else "cpu"

ROUTINGS = {
    # GLM-4.5-Air: 128 experts, one group, top 8, renormalised, scale 1
    "glm-air": MoeConfig(128, 8, 16, scoring="sigmoid", biased=True, norm_topk_prob=True),
    # GLM-4.5: 160 experts (not a power of two), scale 2.5
    "glm": MoeConfig(160, 8, 16, scoring="sigmoid", biased=True, norm_topk_prob=True, routed_scaling_factor=2.5),
    # DeepSeek-V3's groups: 8 groups of 32, the best 4 kept
    "groups": MoeConfig(256, 8, 16, scoring="sigmoid", biased=True, norm_topk_prob=True, n_group=8, topk_group=4,
                        routed_scaling_factor=2.5),
    # ERNIE-4.5: softmax scores, renormalised over max(sum, floor), 64 experts, top 6
    "ernie": MoeConfig(64, 6, 16, scoring="softmax", biased=True, norm_topk_prob=True, norm_floor=1e-12),
    # DeepSeek-V2: softmax scores, no bias, 8 groups of 20 worth their best expert, 3 kept, top 6
    "deepseek-v2": MoeConfig(160, 6, 16, scoring="softmax", biased=True, n_group=8, topk_group=3, group_score="max",
                             routed_scaling_factor=16.0),
    # no renormalisation
    "raw": MoeConfig(60, 4, 16, scoring="sigmoid", biased=True, n_group=4, topk_group=2),
}


def problem(moe: MoeConfig, t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, moe.num_experts, generator=g)
    bias = (0.3 if moe.scoring == "sigmoid" else 0.02) * torch.randn(moe.num_experts, generator=g)
    return logits, bias


@pytest.mark.parametrize("name", ROUTINGS)
@pytest.mark.parametrize("t", [1, 4, 33])
def test_the_kernel_chooses_and_weighs_as_the_reference(name, t):
    moe = ROUTINGS[name]
    logits, bias = problem(moe, t, seed=t + moe.num_experts)
    want_w, want_ids = biased_route(logits, bias, moe)
    assert supported_biased(logits.to(DEVICE), moe)
    w, ids = route_biased(logits.to(DEVICE), bias.to(DEVICE), moe, torch.float32)
    order = want_ids.sort(dim=-1).indices            # torch's sorted=False order is its own
    mine = ids.cpu().sort(dim=-1).indices
    assert torch.equal(ids.cpu().gather(1, mine), want_ids.gather(1, order))
    assert (w.cpu().gather(1, mine) - want_w.gather(1, order)).abs().max() < 1e-6


def test_nan_logits_still_name_distinct_experts_inside_the_table():
    moe = ROUTINGS["groups"]
    logits, bias = problem(moe, 3, seed=1)
    logits[0] = float("nan")
    logits[1, ::5] = float("nan")
    _, ids = route_biased(logits.to(DEVICE), bias.to(DEVICE), moe, torch.float32)
    ids = ids.cpu()
    assert ((ids >= 0) & (ids < moe.num_experts)).all()
    assert all(len(set(row)) == moe.top_k for row in ids.tolist())


@pytest.mark.gpu
def test_the_engine_routes_biased_layers_through_the_kernel_on_a_gpu(tiny_checkpoint, monkeypatch):
    """On a GPU a biased MoE layer's route is the one launch, and the tokens are the torch route's."""
    if not COMPILED:
        pytest.skip("the engine's GPU path needs a GPU")
    from freetoken_engine import LLM, SamplingParams, env
    from freetoken_engine.kernels import gpu_decode_kernels
    from freetoken_engine.kernels.triton import route as kernel
    calls = []
    real = kernel.route_biased

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)
    monkeypatch.setattr(kernel, "route_biased", counted)
    greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    prompt = [5, 17, 99, 200, 3, 44, 12, 300, 8, 9]
    for model in ("glm4_moe", "ernie4_5_moe"):
        folder = tiny_checkpoint(model)
        got = LLM(folder, device="cuda", dtype="float32").generate(prompt, greedy).token_ids
        assert calls
        calls.clear()
        monkeypatch.setenv(env.FREETOKEN_GPU_DECODE_KERNELS,
                           ",".join(k for k in env.GPU_DECODE_KERNELS if k != "route"))
        gpu_decode_kernels.cache_clear()              # the kernel choice is cached per process
        try:
            assert LLM(folder, device="cuda", dtype="float32").generate(prompt, greedy).token_ids == got
            assert not calls                          # that run routed through the torch ops
        finally:
            monkeypatch.delenv(env.FREETOKEN_GPU_DECODE_KERNELS)
            gpu_decode_kernels.cache_clear()
