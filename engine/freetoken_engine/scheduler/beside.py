"""When the requests that are decoding get a step inside a long prefill pass.

A prefill step with part of the experts cached streams the missing ones over PCIe layer by layer
(0.5 s for an 8192-token step of a 48-layer MoE on the H200 with a 32 GB card's cache, whatever
the step's size). Riding in that pass, the requests decoding beside it got one token per pass
(bench/decode_stall.py, device run 128). The scheduler instead leaves them out of a long pass
and runs their decode steps between its layers (``ModelRunner.forward(between=)``), whenever
they have waited ``--decode-pause-ms`` since their last token and at least three times as long
as their last such step took (so decode steps take at most a quarter of a pass's time: on a CPU
they compete with the prefill for the same cores).

``DecodePause`` is that clock. On a GPU the host queues layers ahead of the device, so at each
layer boundary it first waits for the layer before the one just queued: the host is then at most
one layer ahead, and the decode step it queues starts as that layer ends.

A pass shorter than the pause gives the decoders their token sooner by carrying them (and for
free: the pass reads the same weights), so they are left out only of a pass expected to take at
least the pause: ``long(tokens)``, from the time of the last passes of about as many prompt
tokens (power-of-two buckets; a size not seen yet counts as long). On a CPU a pass's time grows
with its tokens; on a GPU with part of the experts cached any whole-layer pass streams them.
"""
from __future__ import annotations

import time
from typing import Callable

import torch


#: the most of a pass's time the decode steps inside it may take: the next one waits for at least
#: (1 - SHARE) / SHARE times the last one's time
SHARE = 0.25


class DecodePause:
    """``pause_s``: how long the decoders may wait for a step inside a pass (the layer running
    when it runs out is finished first). ``clock``: seconds, monotonic (tests pass their own)."""

    def __init__(self, pause_s: float, device: torch.device, clock: Callable[[], float] = time.perf_counter):
        self.pause_s, self.clock = pause_s, clock
        self.device = torch.device(device)
        self.last = clock()            # when the decoders last got a token
        self.cost = 0.0                # how long their last step inside a pass took
        self._queued = None            # the event after the layer queued before this one
        self._pass_s: dict[int, float] = {}   # seconds of a pass by prompt-token bucket (a moving average)

    @staticmethod
    def _bucket(tokens: int) -> int:
        return max(1, tokens - 1).bit_length()

    def long(self, tokens: int) -> bool:
        """Whether a pass of ``tokens`` prompt tokens is expected to take at least the pause."""
        seen = self._pass_s.get(self._bucket(tokens))
        return seen is None or seen >= self.pause_s

    def passed(self, tokens: int, seconds: float) -> None:
        """A pass of ``tokens`` prompt tokens took ``seconds`` (its decode steps beside left out)."""
        b = self._bucket(tokens)
        seen = self._pass_s.get(b)
        self._pass_s[b] = seconds if seen is None else 0.5 * (seen + seconds)

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
        return self.clock() - self.last >= max(self.pause_s, self.cost * (1 - SHARE) / SHARE)

    def ran(self, seconds: float) -> None:
        """The decoders' step inside the pass took ``seconds`` and gave them their tokens."""
        self.cost = seconds
        self.last = self.clock()


__all__ = ["DecodePause"]
