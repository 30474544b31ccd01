"""Constrained decoding on a real GPU (``pytest -m gpu tests/gpu``): the masks are applied on the
device, in one op for a batch (``executor/guide.apply_masks``); the constrained greedy tokens
equal the CPU's in float32 (the tolerance of tests/gpu/test_engine_gpu.py: greedy tokens
identical), alone and in a batch under CUDA graphs with the expert cache and the q* split."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from freetoken_engine import LLM, SamplingParams  # noqa: E402
from freetoken_engine.config import EngineConfig  # noqa: E402
from freetoken_engine.executor import guide  # noqa: E402
from freetoken_engine.scheduler.service import EngineService  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "n"],
          "properties": {"city": {"enum": ["Paris", "Rome"]}, "n": {"type": "integer", "minimum": 0, "maximum": 999}}}
SPEC = guide.GuideSpec(guide.json_schema(SCHEMA))
PROMPTS = [[5, 17, 99, 200, 3, 44, 12, 300], [35, 93, 118, 223, 52], [8, 9, 77, 150, 31, 64, 2, 7, 19]]


def test_masks_on_the_device_equal_the_cpus(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("qwen3_moe"))
    vocab = llm.runner.mcfg.vocab_size
    guides = [guide.Guide(SPEC, llm.tokenizer, vocab) for _ in range(3)]
    guides[1].advance(llm.tokenizer.encode('{"', add_special_tokens=False)[0])
    bits = guide.fill_masks(guides)
    logits = torch.randn(3, vocab)
    assert torch.equal(guide.apply_masks(logits.cuda(), bits).cpu(), guide.apply_masks(logits, bits))


def test_constrained_greedy_tokens_on_the_gpu_equal_the_cpus(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")
    params = SamplingParams(max_new_tokens=40, temperature=0, guide=SPEC, logprobs=2)
    cpu = LLM(folder)
    want = [cpu.generate(p, params).token_ids for p in PROMPTS]
    gpu = LLM(folder, device="cuda", dtype="float32")
    assert [gpu.generate(p, params).token_ids for p in PROMPTS] == want
    svc = EngineService.start(EngineConfig(model=folder, device="cuda", dtype="float32", max_batch=4,
                                           expert_cache_experts=5, cpu_expert_fraction=0.5), wait=True)
    try:
        async def run(p):
            return [ev.token_id async for ev in svc.submit(p, params) if ev.token_id is not None]

        async def together():
            return await asyncio.gather(*(run(p) for p in PROMPTS))
        got = asyncio.run(together())
    finally:
        svc.shutdown()
    assert got == want
    for ids in got:
        answer = json.loads(cpu.tokenizer.decode(ids))
        assert answer["city"] in ("Paris", "Rome") and 0 <= answer["n"] <= 999
