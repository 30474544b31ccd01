"""Decode-graph captures that something else disturbs (``executor/graphs.py`` ``capture``), on a
real GPU: Python's cyclic garbage collector, and a capture that fails."""
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

LOGGER = "freetoken_engine.executor.graphs"


def eager_tokens(folder) -> list:
    return lockstep(LLM(folder, device="cuda", dtype="float32", cuda_graphs=False), PROMPTS, 8)[0]


def spare_graphs(n: int = 64) -> list:
    """Captured graphs to drop inside the engine's captures, one per capture at most."""
    x = torch.zeros(4, device="cuda")
    out = []
    for _ in range(n):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            x.add_(1)
        out.append(g)
    return out


def test_a_collection_of_dead_graphs_during_a_capture_leaves_decode_captured(tiny_checkpoint, monkeypatch, caplog):
    """Dead CUDA graphs in a reference cycle (say, an engine dropped without a close) are freed by
    whichever automatic collection comes next; one inside another engine's capture destroyed them
    there, invalidated that capture, and left its decode eager for good (seen once in a GPU suite
    run, 2026-12-03). Here each capture starts with such a cycle pending and enough allocations
    to trigger a collection: decode is still captured, with the eager engine's tokens."""
    folder = tiny_checkpoint("qwen3_moe")
    want = eager_tokens(folder)
    spare = spare_graphs()
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
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        llm = LLM(folder, device="cuda", dtype="float32")
        got, _ = lockstep(llm, PROMPTS, 8)
    assert dropped, "no capture ran"
    assert "capture failed" not in caplog.text
    assert llm.runner.graphs.enabled and llm.runner.graphs.replays >= 6
    assert got == want
    gc.collect()                             # the dropped graphs go after the captures


@pytest.mark.parametrize("failing", [1, None], ids=["one-failure", "every-capture-fails"])
def test_a_failed_capture_drops_the_graphs_and_only_repeated_failures_leave_decode_eager(
        tiny_checkpoint, monkeypatch, caplog, failing):
    """A capture that fails (here a graph destroyed inside it: a passing cause) drops the graphs,
    and decode is captured again on use; only ``MAX_CAPTURE_FAILURES`` failures (every capture
    failing, as an op that cannot be captured does) leave decode eager for good. Tokens are the
    eager engine's either way, and the stats count the failures."""
    folder = tiny_checkpoint("qwen3_moe")
    want = eager_tokens(folder)
    spare = spare_graphs()
    left = [failing]                         # failures still to make; None: every capture fails
    real = torch.cuda.graph

    class FailsSome(real):
        def __enter__(self):
            super().__enter__()
            if left[0] is None or left[0] > 0:
                left[0] = None if left[0] is None else left[0] - 1
                spare.pop()                  # destroyed inside the capture: it fails at its end

    monkeypatch.setattr(torch.cuda, "graph", FailsSome)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        llm = LLM(folder, device="cuda", dtype="float32")
        got, _ = lockstep(llm, PROMPTS, 8)
    graphs, stats = llm.runner.graphs, llm.runner.graph_stats()
    assert got == want
    if failing == 1:
        assert stats["decode_graph_capture_failures"] == 1
        assert "captured again on use (failure 1 of 3)" in caplog.text
        assert graphs.enabled and graphs.replays >= 6 and stats["decode_graphs"] > 0
    else:
        assert stats["decode_graph_capture_failures"] == graphs.MAX_CAPTURE_FAILURES == 3
        assert "3 times; decode stays eager" in caplog.text
        assert not graphs.enabled and graphs.replays == 0 and stats["decode_graphs"] == 0
