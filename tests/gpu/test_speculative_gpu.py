"""Speculative decoding on a real GPU (``pytest -m gpu tests/gpu``): a drafted step's
verification replays the decode graph of its k + 1 tokens as one-token rows (on the hybrid,
rows chained through the recurrent state: ``kernels/triton/deltanet.py``), beside plain steps
replayed from CUDA graphs, through the expert cache and the q* split; in float32 the tokens equal the plain
engine's on the same GPU (the tolerance of tests/gpu/test_engine_gpu.py: greedy tokens
identical), for an attention MoE and a hybrid one (its recurrent state restored on the device
after a cut-short draft), alone and batched through the scheduler."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
from freetoken_engine import LLM, SamplingParams  # noqa: E402
from freetoken_engine.config import EngineConfig  # noqa: E402
from freetoken_engine.scheduler.service import EngineService  # noqa: E402
from test_speculative import SAMPLED, Oracle, prompts  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
GPU = dict(device="cuda", dtype="float32", expert_cache_experts=6, cpu_expert_fraction=0.5)


def tokens_of_all(svc: EngineService, ids: list[list[int]], params_of) -> list[list[int]]:
    """Each prompt's generated tokens, the prompts submitted to ``svc`` all at once
    (``params_of(i)``: the i-th one's sampling), from a sync test as every GPU test is."""
    async def one(i, p):
        return [ev.token_id async for ev in svc.submit(p, params_of(i)) if ev.token_id is not None]

    async def all_of():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(ids)))
    return asyncio.run(all_of())


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_next"])
def test_drafted_decode_on_the_gpu_equals_plain(tiny_checkpoint, model_type, monkeypatch):
    folder = tiny_checkpoint(model_type)
    plain = LLM(folder, **GPU)
    want = {tuple(p): plain.generate(p, GREEDY).token_ids for p in prompts(3)}
    del plain
    Oracle(want).install(monkeypatch)
    spec = LLM(folder, speculative_tokens=4, **GPU)
    for p in prompts(3):
        got = spec.generate(p, GREEDY)
        assert got.token_ids == want[tuple(p)]
        assert 0 < got.stats["draft_tokens_kept"] < got.stats["draft_tokens"]
        assert got.stats["fills"] > 0 and got.stats["cpu_computed"] > 0      # offload and the split ran
    assert spec.runner.chained_rows == (model_type == "qwen3_next")
    assert any(b > 1 for b, _ in spec.runner.graphs._graphs)   # one request: verifications replayed row graphs


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_next"])
def test_batched_drafts_on_the_gpu_equal_plain(tiny_checkpoint, model_type, monkeypatch):
    """Batched: each drafted step replays a decode graph of one-token rows (``as_decode_rows``),
    chained on the hybrid, beside other requests' plain rows and sampled ones."""
    folder = tiny_checkpoint(model_type)
    runs = {}
    for k in (0, 4):
        if k:
            Oracle({p: t for p, t in zip(map(tuple, prompts(6)), runs[0])}).install(monkeypatch)
        svc = EngineService.start(EngineConfig(model=folder, speculative_tokens=k, speculative_max_batch=6, max_batch=6,
                                               **GPU), wait=True)
        try:
            runs[k] = tokens_of_all(svc, prompts(6), lambda i: SAMPLED if i % 2 else GREEDY)
            svc.scheduler.check_integrity()
            if k:
                assert svc.stats()["draft_tokens_kept"] > 0
        finally:
            svc.shutdown()
    assert runs[4] == runs[0]
