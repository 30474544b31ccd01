"""A forward pass of several sequences with multi-token chunks among them (prompts' chunks
together, or beside decode tokens: what the scheduler runs when a request arrives while others
decode) attends each chunk over its own keys and the single tokens together
(``Attention._by_sequence``), instead of padding every sequence to the longest chunk and the
longest context. Each sequence gets the logits it gets in a pass of its own through the padded
path (``Attention.by_sequence = False``, which matches transformers: tests/engine/test_parity.py),
with Llama 4's chunked layers and Granite swash's sinks too."""
from __future__ import annotations

import pytest
import torch

from freetoken_engine import LLM
from mixed_pass import alone_and_mixed


@pytest.mark.parametrize("kernel", [True, False], ids=["decode-kernel", "matmul"])
@pytest.mark.parametrize("sdpa", [True, False])
@pytest.mark.parametrize("model_type,overrides", [
    ("qwen3_moe", {}), ("mixtral", {"sliding_window": 5}),
    ("llama4_text", {}),        # chunks of 4 positions, tempered queries, L2 q/k norms
    ("granitemoe_swa", {}),     # attention sinks beside windows of 4
])
def test_a_mixed_pass_gives_each_sequence_its_own_logits(tiny_checkpoint, monkeypatch, model_type, overrides, sdpa,
                                                          kernel):
    """The decode tokens go through the fused decode kernel over the paged pool (``kernel``), or,
    where a layer has none, through one matmul per KV head over their gathered keys."""
    from freetoken_engine.layers.attention import Attention
    monkeypatch.setattr(Attention, "sdpa", sdpa)
    llm = LLM(tiny_checkpoint(model_type, **overrides))
    no_kernel = (lambda: monkeypatch.setattr(Attention, "_decode_kernel", lambda self, x, k_cache: None))
    alone, mixed, calls = alone_and_mixed(llm, monkeypatch, None if kernel else no_kernel)
    layers = llm.runner.mcfg.num_layers
    assert calls == ({"_beside_chunks": layers, "_one_token": 0} if kernel else {"_beside_chunks": 0, "_one_token": layers})
    assert (mixed - alone).abs().max() < 1e-4
    assert torch.equal(mixed.argmax(-1), alone.argmax(-1))
