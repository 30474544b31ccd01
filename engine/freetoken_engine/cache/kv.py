"""Paged KV pool: fixed-size blocks of token slots, reference-counted so prefixes can be shared.

``k[layer]`` / ``v[layer]`` are ``[num_blocks * block_size, kv_heads, head_dim]``; a token at
position p of a sequence lives at slot ``block_table[p // block_size] * block_size + p % block_size``.
With ``shared_values`` (latent attention: a token's value row is its key row) ``v`` is ``k``, one
tensor: every writer stores the value before the key (``layers/attention.py``, the decode
kernels), so the key, the later store, is what stays.
Not thread-safe: owned by the scheduler thread.
"""
from __future__ import annotations

import torch

from ..errors import OutOfKVCache


def kv_pool_bytes(layers: int, tokens: int, kv_heads: int, head_dim: int, itemsize: int,
                  shared_values: bool = False) -> int:
    """Bytes a ``KVPool`` of ``tokens`` slots takes (K and V for every layer), before making it."""
    return (1 if shared_values else 2) * layers * tokens * kv_heads * head_dim * itemsize


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, shared_values: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_layers, num_blocks * block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.shared_values = shared_values
        self.v = self.k if shared_values else torch.zeros(shape, dtype=dtype, device=device)
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def nbytes(self) -> int:
        return (1 if self.shared_values else 2) * self.k.numel() * self.k.element_size()

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
        """Drop one reference per block; blocks reaching zero become free."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] < 0:
                raise RuntimeError(f"KV block {b} released more often than taken")
            if self.refs[b] == 0:
                self._free.append(b)

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

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("KV pool: a block is free twice")
        for b, r in enumerate(self.refs):
            if (r == 0) != (b in free):
                raise RuntimeError(f"KV pool: block {b} has {r} references but free={b in free}")
