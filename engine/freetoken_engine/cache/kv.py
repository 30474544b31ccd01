"""Paged KV pool: fixed-size blocks of token slots, reference-counted so prefixes can be shared.

``k[i]`` / ``v[i]`` are ``[num_blocks * block_size, kv_heads, head_dim]``; a token at position p
of a sequence lives at slot ``block_table[p // block_size] * block_size + p % block_size``.
With ``shared_values`` (latent attention: a token's value row is its key row) ``v`` is ``k``, one
tensor: every writer stores the value before the key (``layers/attention.py``, the decode
kernels), so the key, the later store, is what stays.

Sliding-window layers (``windows``) can keep their keys in a smaller store of their own
(``window_blocks`` > 0): a block gets a *window half* there when a pass first writes it
(``before_pass``), and gives it back when it is freed, or when the store runs short and no
sequence can see it any more (``sweep``: a block table's next pass reads back one window from
where it can start at the earliest; ``keep_window`` adds cached prefixes' last windows). Their layers
read through ``window_view``: the same block tables, each block mapped to its window half (0, a
block that stays zero, where it has none: keys the window hides). gpt-oss-20b's 131k-token
context takes 6.4 GB of keys and values in one pool, half of it for layers that see 128 tokens;
3.7 GB with the store (bench/kv_window.py).
Not thread-safe: owned by the scheduler thread.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

import numpy as np
import torch

from ..errors import OutOfKVCache

log = logging.getLogger(__name__)


def kv_pool_bytes(layers: int, tokens: int, kv_heads: int, head_dim: int, itemsize: int,
                  shared_values: bool = False, window_layers: int = 0, window_tokens: int = 0) -> int:
    """Bytes a ``KVPool`` of ``tokens`` slots takes (K and V for every layer; ``window_layers`` of
    the ``layers`` with ``window_tokens`` slots of their own), before making it."""
    slots = (layers - window_layers) * tokens + window_layers * window_tokens
    return (1 if shared_values else 2) * slots * kv_heads * head_dim * itemsize


def window_store_blocks(window: int, block_size: int, max_batch: int, prefill_tokens: int,
                        draft_tokens: int = 0, reserve_tokens: int = 0) -> int:
    """Window halves a sliding-window store needs (its zero block included): every sequence's
    keys within ``window`` of its next token, what one step adds (a prefill chunk of
    ``prefill_tokens`` shared out among them, a draft and a few decode steps beside a long
    prefill each), and ``reserve_tokens`` of cached prefixes' last windows."""
    per_seq = -(-(window + draft_tokens + 1 + BESIDE_TOKENS) // block_size) + 2
    return 1 + max_batch * per_seq + -(-prefill_tokens // block_size) + max_batch + -(-reserve_tokens // block_size)


#: decode tokens a sequence may take beside one long prefill pass (scheduler/beside.py), counted
#: in every sequence's share of the window store
BESIDE_TOKENS = 64
#: cached prefixes whose last windows the store has room for beside its sequences
CACHED_WINDOWS = 16


def kv_windows(cfg, mcfg, kv_blocks: int) -> tuple[tuple[int | None, ...], int]:
    """Each KV layer's sliding window and the window store's blocks for engine config ``cfg`` and
    model config ``mcfg`` (0: none; the windowed layers then keep ``kv_blocks`` blocks like the
    others). A store is made where it is smaller than the pool, for attention-only models
    (a hybrid model's prefixes are kept by its anchor checkpoints; latent attention has no
    windowed layers) unless ``cfg.kv_window_store`` is off."""
    if not mcfg.sliding_window:
        return (), 0
    windows = tuple(mcfg.sliding_window[i] for i in mcfg.attention_layers)
    windows += (None,) * (mcfg.kv_layers - len(windows))           # the MTP layer's: full
    window = max((w for w in windows if w is not None), default=0)
    if not window or not cfg.kv_window_store or mcfg.mla is not None or mcfg.linear_layers:
        return windows, 0
    bs = cfg.kv_block_size
    blocks = window_store_blocks(window, bs, cfg.max_batch, cfg.prefill_tokens, cfg.speculative_tokens,
                                 CACHED_WINDOWS * (window + bs))
    return windows, blocks if blocks < kv_blocks else 0


def model_kv_bytes(cfg, mcfg, kv_blocks: int, itemsize: int) -> int:
    """Bytes ``KVPool.for_model`` takes for these configs (its window store counted), before
    making it."""
    windows, window_blocks = kv_windows(cfg, mcfg, kv_blocks)
    return kv_pool_bytes(mcfg.kv_layers, kv_blocks * cfg.kv_block_size, mcfg.num_kv_heads, mcfg.head_dim, itemsize,
                         shared_values=mcfg.mla is not None,
                         window_layers=len(windows) - windows.count(None) if window_blocks else 0,
                         window_tokens=window_blocks * cfg.kv_block_size)


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, shared_values: bool = False,
                 windows: tuple[int | None, ...] = (), window_blocks: int = 0):
        self.num_blocks, self.block_size = num_blocks, block_size
        win = [j for j, w in enumerate(windows) if w is not None] if window_blocks > 1 and not shared_values else []
        full = [j for j in range(num_layers) if j not in set(win)]
        self.window = max((windows[j] for j in win), default=0)      # 0: no window store
        self._where = {j: (False, i) for i, j in enumerate(full)} | {j: (True, i) for i, j in enumerate(win)}
        shape = (len(full), num_blocks * block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.shared_values = shared_values
        self.v = self.k if shared_values else torch.zeros(shape, dtype=dtype, device=device)
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.window_blocks = window_blocks if win else 0
        wshape = (len(win), self.window_blocks * block_size, kv_heads, head_dim)
        self.kw = torch.zeros(wshape, dtype=dtype, device=device)
        self.vw = torch.zeros(wshape, dtype=dtype, device=device)
        self.half = np.zeros(num_blocks, dtype=np.int64)       # each block's window half (0: none)
        self._win_free = list(range(self.window_blocks - 1, 0, -1))   # half 0 stays zero
        # the map on a GPU (a CPU's passes read ``half`` itself), copied from pinned staging
        gpu = bool(win) and device.type != "cpu"
        self._dirty = gpu
        self._map = torch.zeros(num_blocks if gpu else 0, dtype=torch.int64, device=device)
        self._staging = torch.zeros_like(self._map, device="cpu").pin_memory() if gpu else None
        self._copied = torch.cuda.Event() if gpu else None
        #: more blocks whose window halves a sweep keeps (the prefix tree's: cached prefixes'
        #: last windows, so a request can resume after them), about ``cached_window_blocks``
        self.cached_window_blocks = CACHED_WINDOWS * (self.blocks_for(self.window) + 1)
        self.keep_window: Callable[[], Iterable[int]] | None = None
        self._tables: dict[int, tuple[list[int], int]] = {}   # id -> (block table, its next pass's start)
        self._reading: list[tuple[list[int], int]] = []   # the pass in before_pass: (table, its start)

    @classmethod
    def for_model(cls, cfg, mcfg, kv_blocks: int, dtype: torch.dtype, device: torch.device) -> "KVPool":
        """The pool of ``kv_blocks`` blocks for engine config ``cfg`` and model config ``mcfg``,
        with a window store where ``kv_windows`` makes one."""
        windows, window_blocks = kv_windows(cfg, mcfg, kv_blocks)
        pool = cls(mcfg.kv_layers, kv_blocks, cfg.kv_block_size, mcfg.num_kv_heads, mcfg.head_dim, dtype, device,
                   shared_values=mcfg.mla is not None, windows=windows, window_blocks=window_blocks)
        if pool.window_blocks:
            log.info("sliding-window layers keep their keys in a store of %d blocks beside the pool's %d "
                     "(the KV cache: %.2f GB)", window_blocks, kv_blocks, pool.nbytes / 1e9)
        return pool

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def used_window_blocks(self) -> int:
        """Blocks of the window store holding a block's keys (the zero block not counted)."""
        return max(0, self.window_blocks - 1 - len(self._win_free))

    @property
    def nbytes(self) -> int:
        each = 1 if self.shared_values else 2
        return each * (self.k.numel() * self.k.element_size() + self.kw.numel() * self.kw.element_size())

    def caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KV layer ``layer``'s key and value stores (its window store's for a windowed layer)."""
        windowed, i = self._where[layer]
        return (self.kw[i], self.vw[i]) if windowed else (self.k[i], self.v[i])

    def windowed(self, layer: int) -> bool:
        return self._where[layer][0]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each) or raise ``OutOfKVCache``."""
        if n > len(self._free):
            raise OutOfKVCache(f"KV cache has {len(self._free)} free blocks, {n} needed")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def retain(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference per block; blocks reaching zero become free (their window halves too)."""
        self._tables.pop(id(blocks), None)
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] < 0:
                raise RuntimeError(f"KV block {b} released more often than taken")
            if self.refs[b] == 0:
                self._free.append(b)
                self._drop_half(b)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def extend(self, blocks: list[int], tokens: int) -> None:
        """Append to ``blocks`` (in place) the blocks that holding ``tokens`` tokens needs."""
        need = self.blocks_for(tokens) - len(blocks)
        if need > 0:
            blocks += self.allocate(need)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """The first ``n`` token slots of block ``src`` into block ``dst``, in every layer (a
        shared block whose tail a new sequence writes differently)."""
        a, b = src * self.block_size, dst * self.block_size
        self.k[:, b:b + n].copy_(self.k[:, a:a + n])
        if not self.shared_values:
            self.v[:, b:b + n].copy_(self.v[:, a:a + n])
        if self.window and self.half[src]:
            self._ensure([dst], 0, n)
            a, b = int(self.half[src]) * self.block_size, int(self.half[dst]) * self.block_size
            self.kw[:, b:b + n].copy_(self.kw[:, a:a + n])
            self.vw[:, b:b + n].copy_(self.vw[:, a:a + n])

    # -- the window store --------------------------------------------------------------------
    def window_tail(self, blocks: list[int], position: int) -> list[int]:
        """The blocks of a block table whose keys a token at ``position`` or later can see through
        the window."""
        return blocks[max(0, position - self.window) // self.block_size:] if self.window else []

    def resumable(self, blocks: list[int]) -> int:
        """How many of a cached prefix's leading ``blocks`` a sequence can resume after: the most
        whose last window still has its keys (every block, without a window store)."""
        if not self.window or not blocks:
            return len(blocks)
        missing = np.flatnonzero(self.half[np.asarray(blocks, dtype=np.int64)] == 0)
        for n in range(len(blocks), 0, -1):
            i = int(np.searchsorted(missing, n)) - 1          # the last block without keys before n
            if i < 0 or missing[i] < max(0, n * self.block_size - self.window) // self.block_size:
                return n
        return 0

    def before_pass(self, spans: Iterable[tuple[list[int], int, int, int]]) -> None:
        """Before a pass that writes positions [start, end) of each ``(block table, start, end,
        resume)`` (``resume``: where the table's next pass starts at the earliest, ``end`` unless
        a draft may be cut back; a table may come more than once: a draft's rows): window halves
        for the blocks it writes, then the map onto the device. OutOfKVCache when the store is
        short even after a ``sweep``; RuntimeError if a key a window reads has none (the caller's
        bug)."""
        if not self.window:
            return
        passes: dict[int, tuple[list[int], int, int, int]] = {}
        for table, start, end, resume in spans:
            t, lo, hi, back = passes.get(id(table), (table, start, end, resume))
            passes[id(table)] = (table, min(lo, start), max(hi, end), min(back, resume))
        for table, _, _, resume in passes.values():
            self._tables[id(table)] = (table, resume)
        # what this pass reads before its first new position: kept by any sweep its new blocks
        # call for (a prompt's chunk reads a window behind its start, past its table's resume)
        self._reading = [(table, start) for table, start, _, _ in passes.values()]
        try:
            for table, start, end, _ in passes.values():
                self._ensure(table, start, end)
        finally:
            self._reading = []
        self.sync()

    def forget(self, table: list[int]) -> None:
        """A block table no pass will write again (``release`` forgets the table it is given)."""
        self._tables.pop(id(table), None)

    def _ensure(self, table: list[int], start: int, end: int) -> None:
        bs = self.block_size
        for b in table[start // bs:-(-end // bs)]:
            if self.half[b]:
                continue
            if not self._win_free:
                self.sweep(self._needed())
            if not self._win_free:
                raise OutOfKVCache(f"the sliding-window KV store's {self.window_blocks} blocks are all in use")
            self.half[b] = self._win_free.pop()
            self._dirty = True
        for b in self._read_before(table, start):
            if not self.half[b]:
                raise RuntimeError(f"KV block {b} lost its window keys while a sequence still reads them")

    def _read_before(self, table: list[int], start: int) -> list[int]:
        """The blocks of ``table`` whose keys a pass starting at ``start`` reads behind it."""
        bs = self.block_size
        return table[max(0, start - self.window + 1) // bs:-(-start // bs)]

    def _needed(self) -> set[int]:
        """The blocks whose window halves a sweep keeps: those a live table's next pass can read,
        and ``keep_window``'s. Tables holding a freed block are forgotten."""
        keep = set(self.keep_window()) if self.keep_window is not None else set()
        for table, start in self._reading:
            keep.update(self._read_before(table, start))
        for key, (table, start) in list(self._tables.items()):
            if any(self.refs[b] == 0 for b in table):
                del self._tables[key]
            else:
                keep.update(self.window_tail(table, start))
        return keep

    def sweep(self, keep: set[int]) -> int:
        """Give back the window halves of every block not in ``keep``; returns how many."""
        drop = [int(b) for b in np.flatnonzero(self.half) if int(b) not in keep]
        for b in drop:
            self._drop_half(b)
        return len(drop)

    def _drop_half(self, b: int) -> None:
        if self.half[b]:
            self._win_free.append(int(self.half[b]))
            self.half[b] = 0
            self._dirty = True

    def sync(self) -> None:
        """The block -> window half map onto the GPU, when it changed (before a pass)."""
        if not self._dirty or self._staging is None:
            return
        self._copied.synchronize()              # the last copy has left the staging buffer
        self._staging.numpy()[:] = self.half
        self._map.copy_(self._staging, non_blocking=True)
        self._copied.record()
        self._dirty = False

    def window_view(self, batch):
        """``batch`` (layers/batch.AttnBatch) as the windowed layers read it: every slot mapped to
        its block's window half (the zero block where the block has none), the masks shared."""
        bs = self.block_size

        def mapped(slots: torch.Tensor) -> torch.Tensor:
            if slots.is_cpu:    # NumPy: torch's CPU ops here left its threads spinning beside the
                s = slots.numpy()   # attention kernel's (0.8 ms more a step, bench/kv_window.py)
                return torch.from_numpy(self.half[s // bs] * bs + s % bs)
            return self._map[torch.div(slots, bs, rounding_mode="floor")] * bs + slots % bs
        return dataclasses.replace(batch, kv_index=mapped(batch.kv_index), slot_mapping=mapped(batch.slot_mapping),
                                   _made=batch._made)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("KV pool: a block is free twice")
        for b, r in enumerate(self.refs):
            if (r == 0) != (b in free):
                raise RuntimeError(f"KV pool: block {b} has {r} references but free={b in free}")
        held = [int(h) for h in self.half if h]
        if len(set(held)) != len(held) or set(held) & set(self._win_free) or 0 in self._win_free \
                or len(held) + len(self._win_free) != max(0, self.window_blocks - 1):
            raise RuntimeError("KV pool: the window store's halves drifted")
        if any(self.half[b] for b in free):
            raise RuntimeError("KV pool: a free block holds a window half")
