"""Recurrent state of hybrid models: live slots for running sequences, and checkpoints at anchors.

A Gated DeltaNet layer (``layers/deltanet.py``) carries a sequence's whole past in a fixed-size
state instead of per-token KV, so a cached KV prefix alone cannot resume a sequence: it needs the
state at exactly that prefix's end. ``StatePool`` holds ``live`` slots (one per running sequence)
and ``checkpoints`` more that keep copies of a state at *anchors*; ``Anchors`` decides which
positions are anchors and finds, for a new prompt, the deepest checkpoint whose tokens it starts
with. An anchor is a position right after a semantic boundary token (a turn's end, the end of a
thinking block, of a tool call or of a tool's output) or where a prompt ends and generation
starts: what a coding agent keeps when it edits, trims or re-sends its context, so a new turn
resumes from the nearest surviving anchor instead of prefilling everything again.
Not thread-safe: owned by the scheduler thread (or the ``LLM`` caller).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..config import LinearAttnConfig
from ..errors import OutOfKVCache

#: token strings after which a position is an anchor, where the tokenizer has them
ANCHOR_TOKENS = ("<|im_end|>", "</think>", "</tool_call>", "</tool_response>", "<|endoftext|>", "<|eot_id|>")


class StatePool:
    """``conv [layers, slots, conv - 1, C]`` (model dtype) and ``ssm [layers, slots, v_heads,
    k_dim, v_dim]`` (float32): slots ``0..live-1`` for running sequences, then the anchors'
    checkpoints, then ``scratch`` slots: the states after each token of a speculative draft,
    one of which replaces the live state when the draft is cut short (``executor/speculate.py``)."""

    def __init__(self, layers: int, lin: LinearAttnConfig, live: int, checkpoints: int,
                 dtype: torch.dtype, device: torch.device, scratch: int = 0):
        n = live + checkpoints + scratch
        self.conv = torch.zeros((layers, n, lin.conv - 1, lin.conv_dim), dtype=dtype, device=device)
        self.ssm = torch.zeros((layers, n, lin.v_heads, lin.k_dim, lin.v_dim), dtype=torch.float32, device=device)
        self.live = live
        self.checkpoint_slots = tuple(range(live, live + checkpoints))
        self._free = list(range(live - 1, -1, -1))
        self._scratch = list(range(n - 1, live + checkpoints - 1, -1))

    @staticmethod
    def slot_bytes(layers: int, lin: LinearAttnConfig, itemsize: int) -> int:
        return layers * lin.state_bytes(itemsize)

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * 4

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A live slot for a sequence (its first pass, from position 0, starts it from zeros)."""
        if not self._free:
            raise OutOfKVCache(f"all {self.live} recurrent-state slots are in use")
        return self._free.pop()

    def give(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.live:
            raise RuntimeError(f"state slot {slot} given back twice or never taken")
        self._free.append(slot)

    def take_scratch(self, k: int) -> list[int]:
        """``k`` scratch slots for a draft's snapshots, or fewer (as many as are free)."""
        got = self._scratch[-k:] if k > 0 else []
        del self._scratch[len(self._scratch) - len(got):]
        return got

    def give_scratch(self, slots: list[int]) -> None:
        self._scratch.extend(slots)

    def copy(self, src: int, dst: int) -> None:
        """Every layer's state of slot ``src`` into slot ``dst`` (on the device, in stream order)."""
        self.conv[:, dst].copy_(self.conv[:, src])
        self.ssm[:, dst].copy_(self.ssm[:, src])


@dataclass
class _Checkpoint:
    tokens: list[int]        # the prefix whose state the slot holds
    blocks: list[int]        # the KV blocks of that prefix (its last one maybe partly), one reference held
    last_used: int


class Anchors:
    """Which checkpoints exist and which to take. ``plan`` names the anchor positions of a
    sequence worth a checkpoint; ``reserve`` picks a slot for one (the least recently used
    checkpoint gives way) and ``commit`` records it once the pass that wrote it is done; ``best``
    finds the deepest checkpoint a prompt can resume from. A checkpoint holds a reference to the
    KV blocks of its prefix (``kv``: the ``KVPool``), so its attention layers' keys stay with
    its state; ``drop_oldest`` gives them back when the KV pool runs short."""

    def __init__(self, pool: StatePool, kv, anchor_ids: frozenset[int], per_prompt: int = 4):
        self.pool, self.kv, self.anchor_ids, self.per_prompt = pool, kv, anchor_ids, per_prompt
        self._held: dict[int, _Checkpoint] = {}
        self._pending: set[int] = set()          # reserved for the pass in flight
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self._held)

    def plan(self, tokens: list[int], prompt_len: int, start: int) -> list[int]:
        """Anchor positions in ``(start, prompt_len]`` to checkpoint while the prompt is
        prefilled: its end, and the last ``per_prompt - 1`` boundary tokens' positions before it
        (an agent edits near the end of its context), leaving out those already held."""
        ends = [p for p in range(prompt_len - 1, start, -1) if tokens[p - 1] in self.anchor_ids]
        wanted = sorted({prompt_len, *ends[:self.per_prompt - 1]} if prompt_len > start else set())
        return [p for p in wanted if not self._holds(tokens, p)]

    def after_token(self, token: int) -> bool:
        """Whether the position after a generated ``token`` is an anchor."""
        return token in self.anchor_ids

    def _holds(self, tokens: list[int], p: int) -> bool:
        return any(len(c.tokens) == p and c.tokens == tokens[:p] for c in self._held.values())

    def reserve(self) -> int | None:
        """A checkpoint slot to write in the next pass (no longer held meanwhile), or None when
        there are none."""
        slots = self.pool.checkpoint_slots
        if not slots:
            return None
        free = [s for s in slots if s not in self._held and s not in self._pending]
        if free:
            slot = free[0]
        else:
            held = [s for s in self._held if s not in self._pending]
            if not held:
                return None
            slot = min(held, key=lambda s: self._held[s].last_used)
            self._drop(slot)
        self._pending.add(slot)
        return slot

    def _drop(self, slot: int) -> None:
        self.kv.release(self._held.pop(slot).blocks)

    def drop_oldest(self) -> bool:
        """Forget the least recently used checkpoint (its KV blocks go back); False if none."""
        held = [s for s in self._held if s not in self._pending]
        if not held:
            return False
        self._drop(min(held, key=lambda s: self._held[s].last_used))
        return True

    def blocks_of(self, blocks: list[int], p: int) -> list[int]:
        """The blocks holding a prefix of ``p`` tokens, with a reference taken for a checkpoint."""
        mine = blocks[:self.kv.blocks_for(p)]
        self.kv.retain(mine)
        return mine

    def commit(self, slot: int, tokens: list[int], blocks: list[int]) -> None:
        """The pass that wrote ``slot`` is done: it holds the state after ``tokens``, whose KV is
        in ``blocks`` (from ``blocks_of``)."""
        self._pending.discard(slot)
        self._held[slot] = _Checkpoint(list(tokens), blocks, next(self._clock))

    def cancel(self, slot: int, blocks: list[int]) -> None:
        self._pending.discard(slot)
        self.kv.release(blocks)

    def best(self, tokens: list[int], limit: int) -> tuple[int, int | None, list[int]]:
        """The deepest checkpoint whose tokens ``tokens`` starts with, at most ``limit`` long:
        (its length, its slot, its KV blocks), or (0, None, [])."""
        found = max(((len(c.tokens), s) for s, c in self._held.items()
                     if len(c.tokens) <= limit and c.tokens == tokens[:len(c.tokens)]), default=(0, None))
        if found[1] is None:
            return 0, None, []
        c = self._held[found[1]]
        c.last_used = next(self._clock)
        return found[0], found[1], c.blocks


def anchor_token_ids(tokenizer) -> frozenset[int]:
    """The ids of ``ANCHOR_TOKENS`` that ``tokenizer`` has (none without a tokenizer)."""
    if tokenizer is None:
        return frozenset()
    ids = (tokenizer.token_to_id(t) for t in ANCHOR_TOKENS)
    return frozenset(i for i in ids if i is not None)
