"""A decode-graph capture that fails (``DecodeGraphs.capture_failed``): every graph is dropped and
captured again on use, and only the third failure leaves decode eager for the process. The
captures need a GPU (tests/gpu/test_graph_capture_gpu.py runs the real path); this checks the
policy on the CPU."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from freetoken_engine.executor.graphs import DecodeGraphs
from freetoken_engine.executor.inputs import SeqChunk


def graphs() -> DecodeGraphs:
    model = SimpleNamespace(rotaries=lambda: [])      # no rotary table to size
    return DecodeGraphs(model, None, None, torch.device("cpu"), torch.float32, 4096, 8)


def step(batch: int) -> list[SeqChunk]:
    return [SeqChunk([0], 9, [1]) for _ in range(batch)]


def test_a_failed_capture_drops_the_graphs_and_the_third_leaves_decode_eager(caplog):
    g = graphs()
    held = {(1, 256): SimpleNamespace(used=0), (2, 256): SimpleNamespace(used=0)}
    with caplog.at_level(logging.WARNING, logger="freetoken_engine.executor.graphs"):
        for failure in (1, 2):
            g._graphs.update(held)
            g.tried.update(held)
            g.capture_failed(RuntimeError("operation failed due to a previous error during capture"))
            assert len(g) == 0 and not g.tried            # dropped: captured again on use
            assert g.enabled and g.key(step(2)) == (2, 256)
            assert f"captured again on use (failure {failure} of 3)" in caplog.text
        g.capture_failed(RuntimeError("an op that syncs"))
    assert not g.enabled and g.key(step(2)) is None       # eager for good: no key, no capture
    assert g.capture_failures == g.MAX_CAPTURE_FAILURES == 3
    assert "an op that syncs), 3 times; decode stays eager" in caplog.text
