"""GLM-4.5-family routing (sigmoid scores, correction bias, groups) on the GPU: in bfloat16 the
router stays float32 and the logits stay within tolerance of the float32 CPU engine (itself
token for token with transformers, tests/engine/test_parity.py). Float32 parity on CUDA, decode
graphs and prefetch run the family in test_engine_gpu.py, test_graphs_gpu.py, test_prefetch_gpu.py."""
from __future__ import annotations

import pytest
import torch

from freetoken_engine import LLM
from freetoken_engine.layers.moe import BiasedRouter, SparseMoE

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from test_engine_gpu import routing_margin  # noqa: E402

#: routing decisive at every MoE layer and position of the tiny glm4_moe checkpoint: the kept
#: group above the next by, and the k-th biased score above the next, 0.05 or more (bfloat16's
#: rounding moves a score by about 0.005 here)
DECISIVE = [164, 286, 108, 94, 156, 224, 278, 83, 27, 129, 132, 35]


def choice_gaps(block: SparseMoE, x) -> list[float]:
    """The gaps, smallest over the positions, between the last kept and the first dropped group
    and between the k-th and (k+1)-th biased score among the kept experts."""
    m = block.moe
    s = block.gate(x).sigmoid() + block.gate.e_score_correction_bias
    groups = s.view(s.shape[0], m.n_group, -1).topk(2, dim=-1).values.sum(-1)
    ranked = groups.topk(m.n_group, dim=-1).values
    keep = torch.zeros_like(groups).scatter_(1, groups.topk(m.topk_group, -1).indices, 1.0)
    kept = s.masked_fill(~keep.bool().repeat_interleave(m.num_experts // m.n_group, 1), float("-inf"))
    top = kept.topk(m.top_k + 1, dim=-1).values
    return [float((ranked[:, m.topk_group - 1] - ranked[:, m.topk_group]).min()),
            float((top[:, -2] - top[:, -1]).min())]


def test_bfloat16_on_cuda_keeps_a_float32_router_and_follows_float32(tiny_checkpoint):
    folder = tiny_checkpoint("glm4_moe")
    cpu = LLM(folder, device="cpu", dtype="float32")
    assert routing_margin(cpu, DECISIVE, choice_gaps) > 0.03
    want = cpu.forward_logits(DECISIVE)
    llm = LLM(folder, device="cuda", dtype="bfloat16")
    routers = [m for m in llm.runner.model.modules() if isinstance(m, BiasedRouter)]
    assert routers and all(p.dtype == torch.float32 and p.is_cuda for r in routers for p in r.parameters())
    got = llm.forward_logits(DECISIVE).cpu()
    assert (got - want).abs().max() < 0.1 * max(1.0, want.abs().max().item())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def test_glms_mtp_drafts_on_the_gpu_change_no_token(tmp_path):
    """GLM's MTP layer (test_glm_mtp.py) drafting on the GPU through the expert cache and the q*
    split, its passes replayed from graphs: float32 tokens equal the plain engine's."""
    from test_glm_mtp import glm_mtp_parts
    from test_mtp import PROMPTS, SAMPLED
    from tiny_models import make_tiny_checkpoint
    from freetoken_engine import SamplingParams
    path = make_tiny_checkpoint(tmp_path / "glm", "glm4_moe")
    glm_mtp_parts(path)
    gpu = dict(device="cuda", dtype="float32", expert_cache_experts=6, cpu_expert_fraction=0.5)
    greedy = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    plain = LLM(path, **gpu)
    llm = LLM(path, speculative_tokens=3, speculative_method="mtp", **gpu)
    drafted = 0
    for prompt in PROMPTS:
        for params in (greedy, SAMPLED):
            got = llm.generate(prompt, params)
            assert got.token_ids == plain.generate(prompt, params).token_ids
            drafted += got.stats["draft_tokens"]
    assert drafted > 0 and llm.runner.graph_stats()["mtp_graph_replays"] > 0
