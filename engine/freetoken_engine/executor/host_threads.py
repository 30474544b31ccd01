"""torch's own threads during a CPU engine's small passes.

On a CPU engine the compiled kernels (experts, projections, decode attention, fused layers) run
on a pool of pinned workers of their own (kernels/cpu/pool.h). What torch still runs in a decode
pass is small: the router's softmax and top-k over ``[B, E]``, a few adds, and after the pass the
sampler's argmax over ``[B, V]``. At ``B > 1`` torch splits such ops over its OpenMP team, and
unless ``OMP_WAIT_POLICY=PASSIVE`` was set before torch loaded (importing this package sets it
when torch has not loaded yet; a program that imports torch first gets torch's default), that
team's threads then spin for milliseconds on the cores the kernel's workers need. On the H100
machine's 16-core host a Qwen3-MoE-like model decoded 4 sequences at 72 tok/s, against 390 with
``PASSIVE`` (and 200 at batch 1 either way).

So passes of at most ``MAX_ROWS`` rows run with one torch thread and larger passes (prompts)
with the engine's count. ``sticky``: the count stays as the last pass set it (the sampler after a
decode pass runs on one thread too) until ``restore``; otherwise each pass puts it back.

Larger passes still need torch's team (a prompt's attention, say), so where it spins they stay
slow: on that host the Qwen3-MoE-like model took 1.01 s instead of 0.49 on a 2,048-token prompt and
decoded 16 sequences at 213 instead of 646 tok/s (bench/cpu_combine.py, the variable unset against
``PASSIVE``). ``for_engine`` warns once when the package found torch loaded with the variable unset.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from ..kernels.cpu.layer import MAX_ROWS
from .inputs import SeqChunk

log = logging.getLogger(__name__)
_warned = False


class HostThreads:
    """torch's thread count for the passes of one engine (``full``: the count of larger passes)."""

    def __init__(self, full: int, sticky: bool = True):
        self.full, self.sticky = full, sticky
        self.outer: int | None = None       # the count found before the first change (restore's)

    def _set(self, n: int) -> None:
        now = torch.get_num_threads()
        if now != n:
            if self.outer is None:
                self.outer = now
            torch.set_num_threads(n)

    def for_pass(self, chunks: list[SeqChunk]):
        """A context for one pass of ``chunks``: one torch thread for at most MAX_ROWS rows."""
        rows = sum(len(c.tokens) for c in chunks)
        want = 1 if rows <= MAX_ROWS else self.full
        if self.sticky:
            self._set(want)
            return contextlib.nullcontext()
        return self._scoped(want)

    @contextlib.contextmanager
    def _scoped(self, n: int):
        before = torch.get_num_threads()
        self._set(n)
        try:
            yield
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    def restore(self) -> None:
        """The count found before the engine's passes changed it (a caller's own torch work)."""
        if self.outer is not None and torch.get_num_threads() != self.outer:
            torch.set_num_threads(self.outer)
        self.outer = None


def for_engine(device: torch.device) -> HostThreads | None:
    """The runner's: on a CPU whose compiled kernels load (else torch computes the experts and
    projections itself and keeps its threads), with the count torch has now."""
    if device.type != "cpu":
        return None
    from .. import TORCH_FIRST
    from ..kernels import cpu_experts
    if not cpu_experts.available():
        return None
    global _warned
    if TORCH_FIRST and torch.get_num_threads() > 1 and not _warned:
        _warned = True
        log.warning("torch was imported before freetoken_engine with OMP_WAIT_POLICY unset: its idle threads spin "
                    "on the cores the engine's CPU kernels use (prompts and batches of 9+ rows up to 2-3x slower on "
                    "a 16-core host); set OMP_WAIT_POLICY=PASSIVE before Python starts, or import freetoken_engine "
                    "first")
    return HostThreads(torch.get_num_threads())
