"""Radix tree of KV blocks: requests and turns that share a prompt prefix share its KV blocks.

Each node is one *full* KV block, keyed by its ``block_size`` token ids under its parent, so a
path from the root is a token prefix whose KV already sits in the pool. The tree holds one pool
reference per node; a request using a node holds another (``match`` takes it, the request
releases it when done). Eviction frees least recently used leaves that no request holds.
Not thread-safe: owned by the scheduler thread.
"""
from __future__ import annotations

import itertools

from .kv import KVPool


class _Node:
    __slots__ = ("key", "block", "parent", "children", "last_used", "end")

    def __init__(self, key: tuple[int, ...] | None, block: int, parent: "_Node | None"):
        self.key, self.block, self.parent = key, block, parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_used = 0
        self.end = False          # a whole prompt or sequence ends here (``insert``'s ``end``)


class RadixCache:
    def __init__(self, pool: KVPool):
        self.pool = pool
        self.root = _Node(None, -1, None)
        self._clock = itertools.count(1)
        self.nodes = 0

    def _keys(self, tokens: list[int], n_blocks: int):
        bs = self.pool.block_size
        return (tuple(tokens[i * bs:(i + 1) * bs]) for i in range(n_blocks))

    def match(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Blocks holding the longest cached prefix of ``tokens`` (at most ``max_tokens`` tokens),
        each retained once for the caller."""
        node, blocks, now = self.root, [], next(self._clock)
        for key in self._keys(tokens, max_tokens // self.pool.block_size):
            child = node.children.get(key)
            if child is None:
                break
            child.last_used = now
            blocks.append(child.block)
            node = child
        self.pool.retain(blocks)
        return blocks

    def insert(self, tokens: list[int], blocks: list[int], end: bool = True, marks: tuple[int, ...] = ()) -> None:
        """Record the full blocks of a sequence whose first ``len(blocks) * block_size`` tokens'
        KV is computed. Blocks already in the tree under the same tokens are left as they are,
        but for one whose window keys a window store let go, which the new block holds.
        ``end``: a whole prompt or sequence ends with the last block (not a part of a prompt
        still being computed); ``marks``: more numbers of leading blocks after which a request
        is likely to resume (a system prompt's end). A window store keeps the last window before
        each (``window_blocks``)."""
        node, now, path = self.root, next(self._clock), []
        for key, block in zip(self._keys(tokens, len(blocks)), blocks):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, block, node)
                self.pool.retain([block])
                self.nodes += 1
            elif self.pool.half[block] and not self.pool.half[child.block]:   # the same keys, and its
                self.pool.retain([block])                                    # window's too (a prefix
                self.pool.release([child.block])                             # computed again)
                child.block = block
            child.last_used = now
            node = child
            path.append(node)
        for depth in (*marks, len(path) if end else 0):
            if 0 < depth <= len(path):
                path[depth - 1].end = True

    def window_blocks(self, limit: int) -> list[int]:
        """Blocks of the last windows before the places a request is likely to resume (where a
        prompt or sequence ended, where prefixes part), most recently used first, until about
        ``limit`` blocks: what ``KVPool.sweep`` keeps of the tree."""
        window, bs = self.pool.window, self.pool.block_size
        ends = sorted(((n, d) for n, d in self._depths() if n.end or len(n.children) > 1),
                      key=lambda nd: (-nd[0].last_used, -nd[1]))
        ends = [n for n, _ in ends]
        keep: list[int] = []
        for node in ends:
            if len(keep) >= limit:
                break
            for _ in range(-(-window // bs)):     # the blocks of the window before its end
                if node is self.root:
                    break
                keep.append(node.block)
                node = node.parent
        return keep

    def evict(self, blocks_needed: int) -> int:
        """Free up to ``blocks_needed`` blocks held only by the tree, least recently used leaves
        first; returns how many were freed."""
        freed = 0
        while freed < blocks_needed:
            leaves = [n for n in self._iter() if not n.children and self.pool.refs[n.block] == 1]
            if not leaves:
                break
            for leaf in sorted(leaves, key=lambda n: n.last_used)[: blocks_needed - freed]:
                del leaf.parent.children[leaf.key]
                self.pool.release([leaf.block])
                self.nodes -= 1
                freed += 1
        return freed

    def _depths(self):
        """Every node with its number of blocks from the root."""
        stack = [(n, 1) for n in self.root.children.values()]
        while stack:
            node, depth = stack.pop()
            yield node, depth
            stack.extend((c, depth + 1) for c in node.children.values())

    def _iter(self):
        return (node for node, _ in self._depths())

    def cached_blocks(self) -> int:
        return self.nodes

    def check_integrity(self) -> None:
        """Every node's block is live in the pool, appears once, and keys have block length."""
        seen = set()
        for node in self._iter():
            if node.block in seen:
                raise RuntimeError(f"radix: block {node.block} appears twice")
            seen.add(node.block)
            if self.pool.refs[node.block] < 1:
                raise RuntimeError(f"radix: block {node.block} is in the tree but free in the pool")
            if len(node.key) != self.pool.block_size or node.parent.children.get(node.key) is not node:
                raise RuntimeError("radix: malformed node")
        if len(seen) != self.nodes:
            raise RuntimeError("radix: node count drifted")
