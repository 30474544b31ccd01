"""The sequences of a pass that mixes prompts' chunks with decode tokens, and the last logits of
each, shared by tests/engine/test_mixed_pass_attention.py and its GPU variant."""
from __future__ import annotations

import torch

from freetoken_engine import LLM
from freetoken_engine.executor.inputs import SeqChunk

# (prompt, tokens already in the KV cache before the mixed pass): the pass runs the rest
SEQS = [([5, 17, 99, 200, 3, 44, 12, 300, 8, 9, 77, 150], 7),    # a chunk after earlier keys
        (list(range(20, 29)), 8),                                # a decode token
        ([33, 7, 250, 61, 18, 90], 0),                           # a whole prompt
        ([4, 140, 66], 2),                                       # a decode token, short context
        ([101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 9)]   # a 2-token chunk


def last_logits(llm: LLM, pieces: list[int]) -> torch.Tensor:
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


def alone_and_mixed(llm: LLM, monkeypatch, prepare=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Every sequence's last logits from a pass of its own through the padded path
    (``Attention.by_sequence = False``), then from one mixed pass of them all (after
    ``prepare()``), as float32 on the CPU, and how often the mixed pass ran its decode tokens
    beside the chunks through the fused kernel (``_beside_chunks``) or by matmuls (``_one_token``)."""
    from freetoken_engine.layers.attention import Attention
    monkeypatch.setattr(Attention, "by_sequence", False)
    alone = torch.cat([last_logits(llm, [i]) for i in range(len(SEQS))]).float().cpu()
    monkeypatch.setattr(Attention, "by_sequence", True)
    if prepare is not None:
        prepare()
    calls = {"_beside_chunks": 0, "_one_token": 0}
    for name in calls:
        def counted(self, *args, _real=getattr(Attention, name), _name=name):
            calls[_name] += 1
            return _real(self, *args)
        monkeypatch.setattr(Attention, name, counted)
    return alone, last_logits(llm, list(range(len(SEQS)))).float().cpu(), calls
