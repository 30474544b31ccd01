"""A forward pass of several sequences with multi-token chunks among them (prompts' chunks
together, or beside decode tokens: what the scheduler runs when a request arrives while others
decode) attends each chunk over its own keys and the single tokens together
(``Attention._by_sequence``), instead of padding every sequence to the longest chunk and the
longest context. Each sequence gets the logits it gets in a pass of its own through the padded
path (``Attention.by_sequence = False``, which matches transformers: tests/engine/test_parity.py)."""
from __future__ import annotations

import pytest
import torch

from freetoken_engine import LLM
from freetoken_engine.executor.inputs import SeqChunk

# (prompt, tokens already in the KV cache before the mixed pass): the pass runs the rest
SEQS = [([5, 17, 99, 200, 3, 44, 12, 300, 8, 9, 77, 150], 7),    # a chunk after earlier keys
        (list(range(20, 29)), 8),                                # a decode token
        ([33, 7, 250, 61, 18, 90], 0),                           # a whole prompt
        ([4, 140, 66], 2),                                       # a decode token, short context
        ([101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 9)]   # a 2-token chunk


def _last_logits(llm: LLM, pieces: list[int]) -> torch.Tensor:
    """Prefill each sequence's prefix alone, then run ``pieces`` (indices into SEQS) in one pass."""
    kv, runner = llm.runner.kv, llm.runner
    tables = []
    with torch.inference_mode():
        for i in pieces:
            ids, done = SEQS[i]
            blocks = kv.allocate(kv.blocks_for(len(ids)))
            if done:
                runner.forward([SeqChunk(blocks, 0, ids[:done])])
            tables.append(blocks)
        chunks = [SeqChunk(t, SEQS[i][1], SEQS[i][0][SEQS[i][1]:]) for t, i in zip(tables, pieces)]
        out = runner.forward(chunks).clone()
    for t in tables:
        kv.release(t)
    return out


@pytest.mark.parametrize("kernel", [True, False], ids=["decode-kernel", "matmul"])
@pytest.mark.parametrize("sdpa", [True, False])
@pytest.mark.parametrize("model_type,overrides", [("qwen3_moe", {}), ("mixtral", {"sliding_window": 5})])
def test_a_mixed_pass_gives_each_sequence_its_own_logits(tiny_checkpoint, monkeypatch, model_type, overrides, sdpa,
                                                          kernel):
    """The decode tokens go through the fused decode kernel over the paged pool (``kernel``), or,
    where a layer has none, through one matmul per KV head over their gathered keys."""
    from freetoken_engine.layers.attention import Attention
    monkeypatch.setattr(Attention, "sdpa", sdpa)
    llm = LLM(tiny_checkpoint(model_type, **overrides))
    monkeypatch.setattr(Attention, "by_sequence", False)   # the reference: the padded path, one sequence a pass
    alone = torch.cat([_last_logits(llm, [i]) for i in range(len(SEQS))])
    monkeypatch.setattr(Attention, "by_sequence", True)
    if not kernel:
        monkeypatch.setattr(Attention, "_decode_kernel", lambda self, x, k_cache: None)
    calls = {"_beside_chunks": 0, "_one_token": 0}
    for name in calls:
        def counted(self, *args, _real=getattr(Attention, name), _name=name):
            calls[_name] += 1
            return _real(self, *args)
        monkeypatch.setattr(Attention, name, counted)
    mixed = _last_logits(llm, list(range(len(SEQS))))
    layers = llm.runner.mcfg.num_layers
    assert calls == ({"_beside_chunks": layers, "_one_token": 0} if kernel else {"_beside_chunks": 0, "_one_token": layers})
    assert (mixed - alone).abs().max() < 1e-4
    assert torch.equal(mixed.argmax(-1), alone.argmax(-1))
