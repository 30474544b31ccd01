"""MTP drafts on a real GPU (``pytest -m gpu tests/gpu``): the MTP layer reads the final hidden
states a decode step leaves, whether it ran eagerly or was replayed from a CUDA graph (the graph
copies them out), runs through the expert cache and the q* split like any layer (its CPU pairs
through a host branch of its own), and its passes replay CUDA graphs of their own; in float32
the tokens equal the plain engine's on the same GPU, alone and batched through the scheduler,
with a head fitted to the model's text so that drafts are kept and cut."""
from __future__ import annotations

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
from test_mtp import PROMPTS, SAMPLED, fitted_mtp_model, plain_outputs, total  # noqa: E402
from test_speculative_gpu import tokens_of_all  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
GPU = dict(device="cuda", dtype="float32", expert_cache_experts=12, cpu_expert_fraction=0.5)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    return fitted_mtp_model(tmp_path_factory.mktemp("mtp") / "m", GREEDY, **GPU)


def test_mtp_drafts_on_the_gpu_equal_plain(fitted):
    path, texts = fitted
    llm = LLM(path, speculative_tokens=4, speculative_method="mtp", **GPU)
    outs = plain_outputs(llm, texts, GREEDY)
    for got in outs:
        assert got.stats["fills"] > 0 and got.stats["cpu_computed"] > 0      # offload and the split ran
    assert 0 < total(outs, "draft_tokens_kept") < total(outs, "draft_tokens")
    assert llm.runner.graph_stats()["decode_graph_replays"] > 0               # hidden states out of graphs
    assert llm.runner.graph_stats()["mtp_graph_replays"] > 0   # the MTP passes replayed graphs of their own
    assert llm.runner.chained_rows                           # and the verifications chained decode rows


def test_batched_mtp_drafts_on_the_gpu_equal_plain(fitted):
    path, _ = fitted
    runs = {}
    for method, k in (("ngram", 0), ("mtp", 4)):
        cfg = EngineConfig(model=path, speculative_tokens=k, speculative_method=method, speculative_max_batch=8,
                           max_batch=8, **GPU)
        svc = EngineService.start(cfg, wait=True)
        try:
            runs[method] = tokens_of_all(svc, PROMPTS * 2, lambda i: SAMPLED if i % 2 else GREEDY)
            svc.scheduler.check_integrity()
            if k:
                assert svc.stats()["draft_tokens_kept"] > 0
        finally:
            svc.shutdown()
    assert runs["mtp"] == runs["ngram"]
