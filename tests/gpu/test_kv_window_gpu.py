"""Sliding-window layers' own KV store (``cache/kv.py``) on a real GPU: the block -> window-half
map crosses to the device before each pass and is read inside the captured decode graphs.

Against one pool for every layer, same checkpoint, float32: greedy tokens identical and logits
within 1e-4 (graphs against eager: the graph masks its context bucket's padded keys), three
sequences decoding together through a store that runs short and sweeps."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from freetoken_engine import LLM  # noqa: E402
from freetoken_engine.cache import kv as kvmod  # noqa: E402

from graph_cases import PROMPTS, lockstep  # noqa: E402

SMALL = dict(device="cuda", dtype="float32", kv_block_size=4, max_batch=3, prefill_chunk=16)


def test_graph_decode_through_the_window_store_equals_one_pool(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(kvmod, "BESIDE_TOKENS", 0)
    monkeypatch.setattr(kvmod, "CACHED_WINDOWS", 1)
    folder = tiny_checkpoint("gpt_oss")
    want, want_logits = lockstep(LLM(folder, **SMALL, cuda_graphs=False, kv_window_store=False), PROMPTS, 40)
    for graphs in (False, True):
        llm = LLM(folder, **SMALL, cuda_graphs=graphs)
        kv = llm.runner.kv
        assert 0 < kv.window_blocks < 40          # three sequences of 8-290 tokens: it sweeps
        got, logits = lockstep(llm, PROMPTS, 40)
        assert got == want
        assert (logits - want_logits).abs().max() < 1e-4
        if graphs:
            assert llm.runner.graphs.replays >= 30
        kv.check_integrity()
