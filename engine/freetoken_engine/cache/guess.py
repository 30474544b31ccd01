"""The state of a cross-layer expert prefetch (``DeviceControl.prefetch``): the copies of a
guessed layer's experts, made while the layer before computes.

``GuessedFills`` owns what a prefetch needs beside the cache's own state: its control outputs
(sized for the bound pool, dropped on a resize), its counters, a copy stream of its own and the
event its copies record, and which layer its fills were made for. The control step itself
stays in ``DeviceControl``, which owns the residency it changes.

Ordering contract: at most one prefetch is outstanding. ``launch`` queues its copies behind
everything already on the current stream (the running layer's fill copies first); ``wait``
makes the current stream wait for them, once, before anything reads the guessed slots; ``take``
hands the guessed layer's step the fills it may count against its PCIe share, and waits at once
when the step that runs is another layer's (a guess whose layer went another way). On the CPU
the copies run inline and nothing waits. Not thread-safe: the scheduler thread is the only user.
"""
from __future__ import annotations

import torch

from ..kernels.triton.control_outputs import COUNTERS, ControlOutputs


class GuessedFills:
    """One prefetch's outputs, counters, copy stream and outstanding layer (see the module
    docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # made here, not at first use: a decode graph's capture may be the first use
        self._copier = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._unwaited = False                      # copies not yet waited for by any stream
        #: hits (guesses already resident), misses, fills, cpu_computed, since construction
        self.totals = torch.zeros(4, dtype=torch.int64, device=device)
        self.reset()

    def reset(self) -> None:
        """Forget the outputs and the outstanding layer: a new pool was bound (a resize)."""
        self.outputs_by_pairs: dict[int, ControlOutputs] = {}
        self.layer: int | None = None               # the layer of a prefetch its step has not run for
        self._spent: torch.Tensor | None = None     # that prefetch's fill count [1], on the device

    def outputs(self, pairs: int, experts: int, slots: int) -> ControlOutputs:
        """Fixed output buffers for ``pairs`` guessed pairs on a pool of ``slots`` LRU slots and
        ``experts`` experts a layer: stable addresses for graphs."""
        return ControlOutputs.reused(self.outputs_by_pairs, pairs, experts, slots, self.device)

    def launch(self, layer: int, out: ControlOutputs, gather) -> None:
        """Run ``gather(out)`` (the fills' copies) behind the current stream's work, on the copy
        stream, and remember ``out``'s fills as ``layer``'s spent share."""
        if self._copier is None:
            gather(out)
        else:
            self._copier.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copier):
                gather(out)
                self._copied.record()
            self._unwaited = True
        self.layer = layer
        self._spent = out.step_counts[2:3]

    def wait(self) -> None:
        """The current stream waits for the last launch's copies, if nothing waited yet (a no-op
        otherwise and on the CPU)."""
        if self._unwaited:
            torch.cuda.current_stream(self.device).wait_event(self._copied)
            self._unwaited = False

    def take(self, layer: int, count_fills: bool) -> torch.Tensor | None:
        """For ``layer``'s step: the outstanding prefetch's fill count when it guessed this layer
        and ``count_fills`` (the step fills by a fraction below 1), else None. A prefetch of another
        layer is waited for here. Clears the outstanding layer either way."""
        if self.layer is None:
            return None
        spent = None
        if self.layer != layer:
            self.wait()
        elif count_fills:
            spent = self._spent
        self.layer = None
        return spent

    def counters(self) -> dict[str, int]:
        """The prefetch steps' counts since construction (one sync)."""
        return dict(zip(COUNTERS, (int(v) for v in self.totals.tolist())))
