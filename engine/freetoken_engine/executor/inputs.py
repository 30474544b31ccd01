"""``ForwardInputs``: one forward pass's tensors on the device, built from scheduled sequences.

Data flow: the scheduler hands the runner a list of ``SeqChunk`` (a sequence's block table, the
position of its first new token, and the new token ids); ``build_inputs`` flattens them into
``ForwardInputs`` (token ids, the ``AttnBatch`` attention metadata and the rows whose logits
are wanted: the last new token of each sequence, and each draft token of a speculative
verification, ``SeqChunk.rows``). The index arithmetic runs in NumPy (a few
microseconds per array) and crosses to torch once per array.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ..layers.batch import AttnBatch


@dataclass
class SeqChunk:
    block_table: list[int]    # KV blocks of the sequence (covering start + len(tokens))
    start: int                # position of the first new token (= tokens already in the KV cache)
    tokens: list[int]         # new token ids to run
    last: bool = True         # they end the tokens to run before the next sample (a prompt's last
                              # chunk, a decode token): a prefill seeds the decode cache only then
    state: int = -1           # hybrid models: the sequence's recurrent-state slot (cache/states.py)
    snapshots: tuple[tuple[int, int], ...] = ()   # (position, checkpoint slot): copy the state after
                              # the tokens before ``position`` (in (start, start + len(tokens)])
    rows: int = 1             # logits wanted for the last ``rows`` new tokens (a speculative draft's
                              # verification: the last accepted token and each draft token)
    chain: bool = False       # a decode row that continues the previous row's sequence (a hybrid
                              # draft's verification as decode rows): its recurrent state is the one
                              # that row left, not ``state``'s
    state_out: int = -1       # the slot the recurrent state after this row goes to (-1: ``state``)
    copies: tuple[tuple[int, int], ...] = ()   # (slot, checkpoint slot): state copies to make after
                              # the pass (an anchor checkpoint of a row, ``as_decode_rows``)


@dataclass
class ForwardInputs:
    ids: torch.Tensor         # [T] int64
    batch: AttnBatch
    logits_at: torch.Tensor   # [R] int64 rows whose logits are wanted: each sequence's last ``rows``


def _kv_index(chunks: list[SeqChunk], ends: np.ndarray, block_size: int, width: int) -> np.ndarray:
    """[B, width] KV slot of each position of each sequence (0 past its end)."""
    p = np.arange(width, dtype=np.int64)
    kv_index = np.zeros((len(chunks), width), dtype=np.int64)
    for i, c in enumerate(chunks):
        table = np.asarray(c.block_table, dtype=np.int64)
        e = ends[i]
        kv_index[i, :e] = table[p[:e] // block_size] * block_size + p[:e] % block_size
    return kv_index


def state_chain(chunks: list[SeqChunk]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's recurrent-state slot written (``state_out``, else ``state``) and whether it
    continues the previous row's chain (1) or starts from ``state`` (0): ``kernels/triton/deltanet``'s
    ``chain``."""
    dst = np.array([c.state_out if c.state_out >= 0 else c.state for c in chunks], dtype=np.int64)
    return dst, np.array([int(c.chain) for c in chunks], dtype=np.int64)


def decode_arrays(chunks: list[SeqChunk], block_size: int, width: int, chained: bool = False) -> np.ndarray:
    """One decode step (one new token per sequence) packed for a captured graph: int64
    ``[4 * B + B * width + B]`` = token ids, positions, KV slots written, keys per sequence after
    the step, the ``[B, width]`` KV index (``width`` >= every sequence's keys; 0-padded), then
    each sequence's recurrent-state slot (hybrid models; -1 otherwise). ``chained``: then also
    ``state_chain``'s two ``[B]`` arrays (a graph that takes a hybrid draft's verification rows)."""
    ends = np.array([c.start + 1 for c in chunks], dtype=np.int64)
    kv_index = _kv_index(chunks, ends, block_size, width)
    rows = np.arange(len(chunks))
    head = np.stack([np.array([c.tokens[0] for c in chunks], dtype=np.int64), ends - 1,
                     kv_index[rows, ends - 1], ends])
    parts = [head.reshape(-1), kv_index.reshape(-1), np.array([c.state for c in chunks], dtype=np.int64)]
    return np.concatenate(parts + (list(state_chain(chunks)) if chained else []))


def pass_spans(chunks: list[SeqChunk]):
    """``(block table, start, end, resume)`` of each chunk for ``KVPool.before_pass``: the
    positions it writes, and where its sequence's next pass starts at the earliest (a draft's
    verification may keep only its first token)."""
    return ((c.block_table, c.start, c.start + len(c.tokens), c.start + (1 if c.rows > 1 else len(c.tokens)))
            for c in chunks)


def build_inputs(chunks: list[SeqChunk], block_size: int, device: torch.device) -> ForwardInputs:
    b = len(chunks)
    ends = np.array([c.start + len(c.tokens) for c in chunks], dtype=np.int64)
    counts = np.array([len(c.tokens) for c in chunks], dtype=np.int64)
    lmax, q_max = int(ends.max()), int(counts.max())
    p = np.arange(lmax, dtype=np.int64)
    kv_index = _kv_index(chunks, ends, block_size, lmax)
    kv_valid = p[None, :] < ends[:, None]                                  # [B, Lmax]
    starts = ends - counts
    q_seq = np.repeat(np.arange(b, dtype=np.int64), counts)                 # [T]
    q_idx = np.arange(len(q_seq), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = starts[q_seq] + q_idx
    slots = kv_index[q_seq, positions]
    ids = np.fromiter((t for c in chunks for t in c.tokens), dtype=np.int64, count=len(q_seq))
    chain = state_chain(chunks) if any(c.chain or c.state_out >= 0 for c in chunks) else None

    def dev(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t if device.type == "cpu" else t.to(device, non_blocking=True)

    batch = AttnBatch(positions=dev(positions), slot_mapping=dev(slots), q_seq=dev(q_seq), q_idx=dev(q_idx),
                      kv_index=dev(kv_index), kv_valid=dev(kv_valid), q_max=q_max,
                      needs_mask=not (q_max == 1 and bool(kv_valid.all())),
                      max_position=int(positions.max()),
                      seq_counts=tuple(counts.tolist()), seq_ends=tuple(ends.tolist()),
                      state_slots=tuple(c.state for c in chunks),
                      state_index=dev(np.array([c.state for c in chunks], dtype=np.int64))
                      if chunks[0].state >= 0 else None,
                      state_chain=tuple(dev(a) for a in chain) if chain is not None else None,
                      chain_host=tuple(zip(map(bool, chain[1].tolist()), chain[0].tolist())) if chain is not None else None,
                      snapshots=tuple(tuple((p - c.start, s) for p, s in c.snapshots) for c in chunks)
                      if any(c.snapshots for c in chunks) else None,
                      kv_len=dev(ends) if q_max == 1 else None,   # the fused decode attention (CPU, GPU)
                      write_first=len({id(c.block_table) for c in chunks}) < len(chunks))
    return ForwardInputs(ids=dev(ids), batch=batch, logits_at=dev(logits_rows(chunks, counts)))


def as_decode_rows(chunks: list[SeqChunk], chained: bool = False) -> list[SeqChunk]:
    """A draft's verification chunk (``rows`` equal to its tokens) as that many one-token chunks
    of the same sequence at consecutive positions: a decode step whose rows share a block table
    (one list object: ``build_inputs`` then sets ``AttnBatch.write_first``, and the decode
    attention writes every row's K/V before any row attends), so the pass takes the fused decode
    attention and, on a GPU, replays a captured decode graph.

    A chunk with a recurrent-state slot (a hybrid model) is converted only when ``chained`` (the
    model's Gated DeltaNet layers run chained rows on a GPU: ``runner.chained_rows``): row j then
    continues row j - 1's state (``chain``) and leaves its own in the draft's snapshot slot j (the
    last row in the sequence's slot), which is what the chunk would have written. Its snapshots
    must be the draft's (the scheduler's last ones: one after each token but the last, in order);
    anchor checkpoints before them, at any row's end, become copies of that row's slot after the
    pass (``SeqChunk.copies``), and so do a plain decode step's, so neither runs eagerly. Any other
    chunk stays whole."""
    if all(c.rows == 1 and not (chained and c.snapshots) for c in chunks):
        return chunks
    out = []
    for c in chunks:
        n = len(c.tokens)
        if c.rows == 1 and chained and n == 1 and c.state >= 0 and c.start > 0 and c.snapshots \
                and all(p == c.start + 1 for p, _ in c.snapshots):            # a decode row's anchor
            out.append(dataclasses.replace(c, snapshots=(), copies=tuple((c.state, ck) for _, ck in c.snapshots)))
        elif c.rows <= 1 or c.rows != n:
            out.append(c)
        elif c.state < 0 and not c.snapshots:
            out += [SeqChunk(c.block_table, c.start + j, [t]) for j, t in enumerate(c.tokens)]
        elif chained and c.state >= 0 and c.start > 0 and _draft_snapshots(c):
            dst = [s for _, s in c.snapshots[len(c.snapshots) - (n - 1):]] + [c.state]
            anchors = tuple((dst[p - c.start - 1], ck) for p, ck in c.snapshots[:len(c.snapshots) - (n - 1)])
            rows = [SeqChunk(c.block_table, c.start + j, [t], state=c.state, chain=j > 0, state_out=dst[j])
                    for j, t in enumerate(c.tokens)]
            rows[-1].copies = anchors
            out += rows
        else:
            out.append(c)
    return out


def _draft_snapshots(c: SeqChunk) -> bool:
    """``c``'s last snapshots are one after each of its tokens but the last, in order (the draft's),
    and any before them fall at the end of one of its tokens (anchor checkpoints)."""
    n = len(c.tokens)
    if len(c.snapshots) < n - 1:
        return False
    k = len(c.snapshots) - (n - 1)
    return ([p for p, _ in c.snapshots[k:]] == list(range(c.start + 1, c.start + n))
            and all(c.start < p <= c.start + n for p, _ in c.snapshots[:k]))


def logits_rows(chunks: list[SeqChunk], counts: np.ndarray) -> np.ndarray:
    """The pass's rows whose logits are wanted, in sequence order: each sequence's last ``rows``."""
    ends = np.cumsum(counts)
    if all(c.rows == 1 for c in chunks):
        return ends - 1
    return np.concatenate([np.arange(e - c.rows, e) for c, e in zip(chunks, ends)])
