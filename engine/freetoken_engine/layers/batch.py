"""``AttnBatch``: where one forward pass's new tokens go and what each sequence reads.

Built by the executor for each pass (``executor/inputs.py``) and read by every token-mixing layer:
the attention layers (KV slots, masks, row lists) and the Gated DeltaNet layers (recurrent-state
slots, which sequences start fresh, the checkpoints to take). Masks and row lists are made once
per pass and kept.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


@dataclass
class AttnBatch:
    """Attention metadata for one forward pass of B sequences and T new tokens (all on device)."""

    positions: torch.Tensor     # [T] int64 absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64 KV slot each new token writes
    q_seq: torch.Tensor         # [T] int64 sequence of each new token
    q_idx: torch.Tensor         # [T] int64 index of the token among its sequence's new tokens
    kv_index: torch.Tensor      # [B, Lmax] int64 KV slots each sequence reads (padded with 0)
    kv_valid: torch.Tensor      # [B, Lmax] bool
    q_max: int
    needs_mask: bool = True     # False when every query may see every key it reads (1-token decode)
    max_position: int | None = None   # max(positions), known on the host
    kv_len: torch.Tensor | None = None  # [B] int64 keys of each sequence after this pass (fused decode)
    seq_counts: tuple[int, ...] | None = None   # new tokens of each sequence (host), in row order
    seq_ends: tuple[int, ...] | None = None     # keys of each sequence after this pass (host)
    state_slots: tuple[int, ...] | None = None  # hybrid models: each sequence's recurrent-state slot
    state_index: torch.Tensor | None = None     # [B] int64 the same on the device (all a captured step has)
    snapshots: tuple[tuple[tuple[int, int], ...], ...] | None = None   # (offset, checkpoint slot) per sequence
    # rows in chains (a hybrid draft's verification as decode rows): ([B] slot each row's state goes
    # to, [B] 1 where a row continues the previous row's sequence), on the device; None: each row
    # reads and writes ``state_index`` (kernels/triton/deltanet.py)
    state_chain: tuple[torch.Tensor, torch.Tensor] | None = None
    chain_host: tuple[tuple[bool, int], ...] | None = None   # the same on the host: (continues, slot written)
    write_first: bool = False   # rows share a sequence (a draft's verification as decode rows): every
                                # row's K/V is written before any row attends
    _made: dict = field(default_factory=dict)   # masks and row lists, made once per pass

    @property
    def aligned(self) -> bool:
        """Every sequence has ``q_max`` new tokens, the last of the ``Lmax`` keys it reads (no
        padding): causal is the lower-right triangle, no mask needed. False without the host's
        counts (a captured decode step)."""
        return (self.seq_counts is not None and all(n == self.q_max for n in self.seq_counts)
                and all(e == self.kv_index.shape[1] for e in self.seq_ends))

    def fresh(self, i: int) -> bool:
        """Sequence i's pass starts at position 0 (its recurrent state starts from zeros)."""
        return self.seq_ends[i] == self.seq_counts[i]

    def snaps(self, i: int) -> tuple[tuple[int, int], ...]:
        """Copies of sequence i's recurrent state to take: (tokens of this pass run, checkpoint slot)."""
        return self.snapshots[i] if self.snapshots is not None else ()

    @property
    def q_flat(self) -> torch.Tensor:
        """[T] row of each new token in the padded ``[B * Qmax]`` query layout."""
        return self.q_seq * self.q_max + self.q_idx

    def mask(self, window: int | None, chunk: int | None = None) -> torch.Tensor:
        """[B, 1, Qmax, Lmax] bool: True where a query may attend to a key (causal, sliding-window,
        within the query's chunk of ``chunk`` positions), cached per kind; shaped for
        ``scaled_dot_product_attention``."""
        key = window if chunk is None else (window, chunk)
        if key not in self._made:
            b = self.kv_index.shape[0]
            qpos = torch.full((b * self.q_max,), -1, dtype=torch.int64, device=self.positions.device)
            qpos = qpos.index_copy(0, self.q_flat, self.positions).view(b, self.q_max)
            kpos = torch.arange(self.kv_index.shape[1], device=qpos.device)
            m = self.kv_valid[:, None, :] & (kpos[None, None, :] <= qpos[:, :, None])   # [B, Q, L]
            if window is not None:
                m &= kpos[None, None, :] > qpos[:, :, None] - window
            if chunk is not None:
                m &= kpos[None, None, :] >= qpos[:, :, None] - qpos[:, :, None] % chunk
            m[:, :, 0] |= qpos < 0          # padded query rows see one key: no NaN rows
            self._made[key] = m[:, None]
        return self._made[key]

    def singles(self) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor] | None:
        """The sequences with one new token (``seq_counts``), for ``Attention._by_sequence``:
        (their indices, their rows, their longest key count, their key counts), made once per
        pass; None when there are none."""
        if "singles" not in self._made:
            dev = self.kv_index.device
            one = [i for i, n in enumerate(self.seq_counts) if n == 1]
            first = list(itertools.accumulate(self.seq_counts, initial=0))      # each sequence's first row
            starts, ends = [first[i] for i in one], [self.seq_ends[i] for i in one]
            self._made["singles"] = (torch.tensor(one, device=dev), torch.tensor(starts, device=dev), max(ends),
                                      torch.tensor(ends, device=dev)) if one else None
        return self._made["singles"]

    def chunk_rows(self) -> torch.Tensor:
        """The rows of the sequences with more than one new token, in order (made once per pass)."""
        if "chunk_rows" not in self._made:
            first = itertools.accumulate(self.seq_counts, initial=0)
            rows = [r for n, a in zip(self.seq_counts, first) if n > 1 for r in range(a, a + n)]
            self._made["chunk_rows"] = torch.tensor(rows, dtype=torch.int64, device=self.kv_index.device)
        return self._made["chunk_rows"]

    def padding(self) -> torch.Tensor:
        """[B, 1, Lmax, 1] bool: True at the padding of ``kv_index``, shaped for the keys and
        values [B, kvh, L, d]. A padding entry reads slot 0, whatever sequence holds it; the mask
        hides it, but a NaN key makes its score NaN before the mask applies and 0 * NaN is NaN,
        so its key and value are zeroed: one request's NaN never reaches the others in its batch."""
        if "padding" not in self._made:
            self._made["padding"] = ~self.kv_valid[:, None, :, None]
        return self._made["padding"]
