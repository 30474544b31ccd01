"""When the requests that are decoding get a step inside a long prefill pass.

A prefill step with part of the experts cached streams the missing ones over PCIe layer by layer
(0.5 s for an 8192-token step of a 48-layer MoE on the H200 with a 32 GB card's cache, whatever
the step's size). Riding in that pass, the requests decoding beside it got one token per pass
(bench/decode_stall.py, device run 128). The scheduler instead leaves them out of a long pass
and runs their decode steps between its layers (``ModelRunner.forward(between=)``), whenever
they have waited ``--decode-pause-ms`` since their last token and at least as long as their last
such step took (so decode steps never take more than half of a pass's time).

``DecodePause`` is that clock. On a GPU the host queues layers ahead of the device, so at each
layer boundary it first waits for the layer before the one just queued: the host is then at most
one layer ahead, and the decode step it queues starts as that layer ends.
"""
from __future__ import annotations

import time
from typing import Callable

import torch


class DecodePause:
    """``pause_s``: how long the decoders may wait for a step inside a pass (the layer running
    when it runs out is finished first). ``clock``: seconds, monotonic (tests pass their own)."""

    def __init__(self, pause_s: float, device: torch.device, clock: Callable[[], float] = time.perf_counter):
        self.pause_s, self.clock = pause_s, clock
        self.device = torch.device(device)
        self.last = clock()            # when the decoders last got a token
        self.cost = 0.0                # how long their last step inside a pass took
        self._queued = None            # the event after the layer queued before this one

    def begin(self) -> None:
        """A pass starts: no layer of it is queued yet."""
        self._queued = None

    def tokens(self) -> None:
        """The decoders got a token outside a pass (a step of their own, or riding in one)."""
        self.last = self.clock()

    def due(self) -> bool:
        """At a layer boundary of a pass: whether the decoders' step runs now."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            before, self._queued = self._queued, ev
            if before is not None:
                before.synchronize()
        return self.clock() - self.last >= max(self.pause_s, self.cost)

    def ran(self, seconds: float) -> None:
        """The decoders' step inside the pass took ``seconds`` and gave them their tokens."""
        self.cost = seconds
        self.last = self.clock()


__all__ = ["DecodePause"]
