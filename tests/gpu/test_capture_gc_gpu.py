"""A decode-graph capture beside Python's cyclic garbage collector (``executor/graphs.py``
``capture``), on a real GPU."""
from __future__ import annotations

import gc
import logging

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from freetoken_engine import LLM  # noqa: E402

from graph_cases import PROMPTS, lockstep  # noqa: E402


def test_a_collection_of_dead_graphs_during_a_capture_leaves_decode_captured(tiny_checkpoint, monkeypatch, caplog):
    """Dead CUDA graphs in a reference cycle (say, an engine dropped without a close) are freed by
    whichever automatic collection comes next; one inside another engine's capture destroyed them
    there, invalidated that capture, and left its decode eager for good (seen once in a GPU suite
    run, 2026-12-03). Here each capture starts with such a cycle pending and enough allocations
    to trigger a collection: decode is still captured, with the eager engine's tokens."""
    folder = tiny_checkpoint("qwen3_moe")
    want, _ = lockstep(LLM(folder, device="cuda", dtype="float32", cuda_graphs=False), PROMPTS, 8)
    x = torch.zeros(4, device="cuda")
    spare = []
    for _ in range(64):                      # graphs to drop, one per capture the engine makes
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            x.add_(1)
        spare.append(g)
    real = torch.cuda.graph
    dropped = []

    class DropsAGraph(real):
        def __enter__(self):
            super().__enter__()              # capturing from here
            if spare:
                cycle = [spare.pop()]
                cycle.append(cycle)          # unreachable: only a collection frees it
                dropped.append(1)
                del cycle
            junk = [[] for _ in range(5 * gc.get_threshold()[0])]   # an automatic collection's worth
            del junk

    monkeypatch.setattr(torch.cuda, "graph", DropsAGraph)
    with caplog.at_level(logging.WARNING, logger="freetoken_engine.executor.graphs"):
        llm = LLM(folder, device="cuda", dtype="float32")
        got, _ = lockstep(llm, PROMPTS, 8)
    assert dropped, "no capture ran"
    assert "capture failed" not in caplog.text
    assert llm.runner.graphs.enabled and llm.runner.graphs.replays >= 6
    assert got == want
    gc.collect()                             # the dropped graphs go after the captures
