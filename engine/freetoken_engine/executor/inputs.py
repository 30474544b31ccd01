"""``ForwardInputs``: one forward pass's tensors on the device, built from scheduled sequences.

Data flow: the scheduler hands the runner a list of ``SeqChunk`` (a sequence's block table, the
position of its first new token, and the new token ids); ``build_inputs`` flattens them into
``ForwardInputs`` (token ids, the ``AttnBatch`` attention metadata and the rows whose logits
are wanted: the last new token of each sequence).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.attention import AttnBatch


@dataclass
class SeqChunk:
    block_table: list[int]    # KV blocks of the sequence (covering start + len(tokens))
    start: int                # position of the first new token (= tokens already in the KV cache)
    tokens: list[int]         # new token ids to run


@dataclass
class ForwardInputs:
    ids: torch.Tensor         # [T] int64
    batch: AttnBatch
    logits_at: torch.Tensor   # [B] int64 row of each sequence's last new token


def build_inputs(chunks: list[SeqChunk], block_size: int, device: torch.device) -> ForwardInputs:
    ids, pos, slots, q_seq, q_idx, last = [], [], [], [], [], []
    lmax = max(c.start + len(c.tokens) for c in chunks)
    kv_index = torch.zeros((len(chunks), lmax), dtype=torch.int64)
    kv_valid = torch.zeros((len(chunks), lmax), dtype=torch.bool)
    for b, c in enumerate(chunks):
        n, end = len(c.tokens), c.start + len(c.tokens)
        table = torch.tensor(c.block_table, dtype=torch.int64)
        p = torch.arange(end)
        seq_slots = table[p // block_size] * block_size + p % block_size      # [end]
        kv_index[b, :end] = seq_slots
        kv_valid[b, :end] = True
        ids.extend(c.tokens)
        pos.extend(range(c.start, end))
        slots.extend(seq_slots[c.start:].tolist())
        q_seq.extend([b] * n)
        q_idx.extend(range(n))
        last.append(len(ids) - 1)
    as_long = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    batch = AttnBatch(positions=as_long(pos), slot_mapping=as_long(slots), q_seq=as_long(q_seq),
                      q_idx=as_long(q_idx), kv_index=kv_index.to(device), kv_valid=kv_valid.to(device),
                      q_max=max(len(c.tokens) for c in chunks))
    return ForwardInputs(ids=as_long(ids), batch=batch, logits_at=as_long(last))
