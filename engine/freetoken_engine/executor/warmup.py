"""Decode CUDA graphs captured ahead of time: at the engine's start, and when the server is idle.

``GraphWarmup`` is a part of ``ModelRunner`` (executor/runner.py): it runs dummy decode steps
through the runner's own ``forward``, which captures each new key's graph after its eager step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch

from .inputs import SeqChunk

log = logging.getLogger(__name__)


class GraphWarmup:
    """The runner's ahead-of-time graph capture (needs ``graphs``, ``kv``, ``cache``, ``experts``,
    ``forward``, ``idle_warm``, ``graph_warmup_seconds`` and ``_warming`` of ``ModelRunner``)."""

    def dummy_decode(self, scratch: list[int], width: int, batch: int) -> list[SeqChunk]:
        """A decode step of ``batch`` dummy tokens at the last position of KV ``width``, every
        sequence reading and writing only the ``scratch`` block (``kv.allocate(1)``) and, for a
        hybrid model, state slot 0 (the warm-ups run while no request holds a slot)."""
        state = 0 if self.states is not None else -1      # a hybrid model's: free while nothing runs
        return [SeqChunk(scratch * -(-width // self.kv.block_size), width - 1, [0], state=state) for _ in range(batch)]

    def _warm_keys(self, batches: int, widths: int | None = None) -> list[tuple[int, int]]:
        """Decode graph keys (B, width) of batch sizes 1..``batches`` at the narrowest ``widths``
        KV widths (every width when None), narrow first, that are neither captured nor tried."""
        g = self.graphs
        if g is None or not g.enabled:
            return []
        ws = g.widths()[:widths]
        return [(b, w) for w in ws for b in range(1, min(batches, g.max_batch) + 1)
                if (b, w) not in g and (b, w) not in g.tried]

    def warm_graphs(self, batches: int, bank_pending: bool = False, widths: int | None = None) -> int:
        """Capture the decode graphs of batch sizes 1..``batches`` at the narrowest ``widths`` KV
        widths (every width when None) now, before any request, and replay each once (a graph's
        first launch also uploads it to the device); returns how many were captured. Each key's
        step is a dummy token at the width's last position on one scratch KV block (released
        after). Their dummy steps route through the expert cache like a short prompt would, so
        residency may change (never an output), but they are not counted in the cache's
        statistics. ``bank_pending``: the bank is still being read, so the steps run with every
        expert resident (``OffloadedExperts.all_resident``: no fill, no CPU pair, nothing read
        from the bank) and leave the cache as it was."""
        before = self.graph_warmup_seconds
        n = self._warm(self._warm_keys(batches, widths), resident=bank_pending)
        log.info("captured %d decode graphs ahead of time in %.1f s", n, self.graph_warmup_seconds - before)
        return n

    def idle_warm_pending(self) -> bool:
        """Whether decode graphs left for later remain: the wider KV widths the start did not
        capture (``--graph-warmup-widths``), or every key again after a resize or a q* change."""
        return bool(self.idle_warm and self._warm_keys(self.idle_warm))

    def warm_idle(self) -> int:
        """Capture one decode graph left for later (``idle_warm_pending``), with every expert
        resident so that the cache a conversation left stays as it was. The scheduler calls it
        when it has nothing else to do, so a request waits for one capture at most. -> 1 when
        one was captured (a key that cannot be captured is tried once)."""
        return self._warm(self._warm_keys(self.idle_warm)[:1], resident=True) if self.idle_warm else 0

    @torch.inference_mode()
    def _warm(self, keys: list[tuple[int, int]], resident: bool) -> int:
        if not keys:
            return 0
        before = None
        if self.cache is not None:
            self.experts.sync_stats()
            before = dataclasses.replace(self.cache.stats)
        t0 = time.perf_counter()
        n = 0
        replays = self.graphs.replays             # the warm-up's replays are not serving's
        scratch = self.kv.allocate(1)             # every dummy sequence reads and writes only it
        inside = (self.experts.all_resident() if resident and self.cache is not None
                  else contextlib.nullcontext())
        self._warming = True
        try:
            with inside:
                for b, width in keys:
                    chunks = self.dummy_decode(scratch, width, b)
                    key = self.graphs.key(chunks)
                    if key is not None and key not in self.graphs:
                        self.forward(chunks)      # its eager run, then the capture
                        if key in self.graphs:
                            n += 1
                            self.forward(chunks)  # its first replay too (bench/graph_first_replay.py)
                    for c in chunks:
                        self.kv.forget(c.block_table)
        finally:
            self._warming = False
            self.kv.release(scratch)
            self.graphs.replays = replays
        if before is not None:
            self.experts.sync_stats()
            for f in dataclasses.fields(before):
                setattr(self.cache.stats, f.name, getattr(before, f.name))
        self.graph_warmup_seconds += time.perf_counter() - t0
        return n
