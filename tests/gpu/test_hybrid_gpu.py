"""Hybrid models (Gated DeltaNet + gated attention) on a real GPU: CUDA against transformers on the
CPU, decode steps captured as CUDA graphs against eager ones, offload and the q* split, and anchor
checkpoints through the scheduler.

Tolerances where GPU and CPU arithmetic meet: float32 logits within 1e-3 of transformers on the
CPU (summation order; 1e-2 over a 150-token prompt: device run 137 measured 4.4e-3 at one position
of Qwen3.5's tiny checkpoint, whose gated norm divides a head's near-zero output by its RMS, where
transformers in float32 is itself 1.7e-4 from float64 on the CPU), greedy tokens identical; graphs against eager decode, and a partly resident
expert cache with half the misses on the CPU against everything resident: identical tokens."""
from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from freetoken_engine import LLM, SamplingParams  # noqa: E402
from freetoken_engine.config import EngineConfig  # noqa: E402
from freetoken_engine.llm import Lockstep  # noqa: E402
from freetoken_engine.scheduler.service import EngineService  # noqa: E402
from tiny_models import gpu_reference  # noqa: E402

PROMPT = [5, 17, 99, 200, 3, 44, 12, 300, 8, 9, 77, 150]
LONG = [(7 * i + 3) % 300 + 10 for i in range(150)]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text", "granitemoehybrid", "kimi_linear"])
def test_cuda_float32_matches_transformers_on_cpu(tiny_checkpoint, model_type):
    folder = tiny_checkpoint(model_type)
    ref = gpu_reference(folder, model_type)
    ref.generation_config.eos_token_id = None
    llm = LLM(folder, device="cuda", dtype="float32")
    assert llm.runner.graphs is not None                       # decode runs as captured graphs
    for ids, tolerance in ((PROMPT, 1e-3), (LONG, 1e-2)):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        assert (llm.prefill_logits(ids).cpu() - want).abs().max() < tolerance
        hf = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert llm.generate(ids, GREEDY).token_ids == hf[0, len(ids):].tolist()
    assert llm.runner.graph_stats()["decode_graph_replays"] > 0
    assert (llm.forward_logits(PROMPT).cpu() - ref(torch.tensor([PROMPT])).logits[0].detach()).abs().max() < 1e-3


def lockstep(llm: LLM, prompts, steps: int) -> list[list[int]]:
    run = Lockstep(llm, prompts)
    try:
        for _ in range(steps):
            run.step()
        return run.tokens
    finally:
        run.close()


def test_graphs_offload_and_the_split_leave_the_tokens_unchanged(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_5_moe_text")
    prompts = [PROMPT, LONG[:40], LONG[3:70], PROMPT[::-1]]
    want = lockstep(LLM(folder, device="cuda", dtype="float32", cuda_graphs=False), prompts, 16)
    graphs = LLM(folder, device="cuda", dtype="float32")
    assert lockstep(graphs, prompts, 16) == want
    assert graphs.runner.graph_stats()["decode_graph_replays"] >= 10
    split = LLM(folder, device="cuda", dtype="float32", expert_cache_experts=10, cpu_expert_fraction=0.5)
    assert lockstep(split, prompts, 16) == want
    stats = split.runner.expert_stats()
    assert stats["cpu_computed"] > 0 and stats["fills"] > 0


def test_a_second_turn_resumes_from_its_anchor_on_the_gpu(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_next")
    fresh = LLM(folder, device="cuda", dtype="float32")

    async def run():
        svc = EngineService.start(EngineConfig(model=folder, device="cuda", dtype="float32"), wait=True)
        try:
            tok = svc.runner.tokenizer
            end = tok.token_to_id("<|im_end|>")
            p1 = tok.encode("<|im_start|>user\nWhat is the capital of France?") + [end] + \
                tok.encode("\n<|im_start|>assistant\n")
            h1 = svc.submit(p1, GREEDY)
            r1 = [e.token_id async for e in h1 if e.token_id is not None]
            p2 = p1 + r1 + [end] + tok.encode("\n<|im_start|>user\nAnd of Spain?") + [end] + \
                tok.encode("\n<|im_start|>assistant\n")
            h2 = svc.submit(p2, GREEDY)
            r2 = [e.token_id async for e in h2 if e.token_id is not None]
            return p2, r2, h2.cached_tokens, svc.stats()
        finally:
            svc.shutdown()
    p2, r2, cached, stats = asyncio.run(run())
    assert cached > 0 and stats["anchor_resumes"] == 1 and stats["decode_graph_replays"] > 0
    assert r2 == fresh.generate(p2, GREEDY).token_ids


def test_decode_steps_that_write_anchor_checkpoints_replay_graphs(tiny_checkpoint, monkeypatch):
    """Every generated token made an anchor: each decode step then writes a checkpoint, which on
    a GPU is a copy of the row's state after the pass (``SeqChunk.copies``), so the steps still
    replay decode graphs. The tokens equal a plain run's, and a second request whose prompt is the
    first one's whole text resumes from the last checkpoint (written by such a copy) and decodes
    what a fresh engine decodes."""
    from freetoken_engine.cache.states import Anchors
    folder = tiny_checkpoint("qwen3_next")
    fresh = LLM(folder, device="cuda", dtype="float32")
    want = fresh.generate(PROMPT, GREEDY).token_ids
    monkeypatch.setattr(Anchors, "after_token", lambda self, token: True)

    async def run():
        svc = EngineService.start(EngineConfig(model=folder, device="cuda", dtype="float32"), wait=True)
        try:
            r1 = [e.token_id async for e in svc.submit(PROMPT, GREEDY) if e.token_id is not None]
            before = svc.stats()
            h2 = svc.submit(PROMPT + r1, GREEDY)
            r2 = [e.token_id async for e in h2 if e.token_id is not None]
            return r1, r2, h2.cached_tokens, before, svc.stats()
        finally:
            svc.shutdown()
    r1, r2, cached, before, after = asyncio.run(run())
    assert r1 == want
    assert before["anchor_checkpoints"] >= len(r1) - 1 and before["decode_graph_replays"] >= len(r1) - 2
    assert after["anchor_resumes"] == 1 and cached > len(PROMPT)      # a checkpoint a decode step wrote
    assert r2 == fresh.generate(PROMPT + r1, GREEDY).token_ids
