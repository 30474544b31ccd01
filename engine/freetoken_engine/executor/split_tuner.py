"""Online refinement of q* (the fill fraction) by measured decode step time.

Calibration balances bandwidths: fills cost S / B_pcie, CPU experts S / B_cpu (kernels/split.py).
The model leaves out the GPU's serial work after a layer's fills (the experts computed from the
filled slots, the merge) and how much the fills slow the CPU (the DMA reads the same host memory),
so the best split on a real engine may sit elsewhere. On the H200 with the 4-layer Qwen3-30B-shaped
engine, after the copy-order fix of 2026-11-29 (run N, bench/results/engine_gpu_decode.json),
fixed splits of 0.2 / 0.3 gave 0.94-1.11x the calibrated q* (0.37); in the MoE benchmark a fixed
0.3 beat the bandwidth split in most uniform-routing rows while locality routing at batch 1 was
faster at the bandwidth split (fills there turn into later hits).

So the engine starts from the calibrated q and measures: windows of ``window`` decode steps of one
batch size at the current best q, at q - delta and at q + delta; a probe that is faster by more than
``margin`` becomes the best, otherwise delta halves; below ``min_delta`` it holds, re-probing every
``recheck`` windows (the load and the routing drift). A window is discarded whenever the batch
size changes or a prefill step comes between two decode steps; the first ``skip`` steps after each
change of q are not timed (the decode graphs are captured again). The split never changes the
output (the CPU and the GPU compute the same experts), only the time.

Off by default (``--split-tuning`` turns it on). Measured on the H200 after the copy-order fix
(run N, the q it found held for the same timed steps as the calibrated one): 0.81-1.07x the
calibrated q. Before the fix (the host waited for PCIe, so every fill added its time to the step)
it settled at q 0.0-0.13; a window sees what a fill costs now but not the hits it brings later,
so the search leans towards filling less than it should, which costs most where routing has
locality.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class SplitTuner:
    def __init__(self, q: float, delta: float = 0.1, min_delta: float = 0.025, window: int = 32,
                 skip: int = 3, margin: float = 0.03, recheck: int = 64):
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"fill fraction must be within 0..1, got {q}")
        self.delta0, self.min_delta, self.window, self.skip = delta, min_delta, window, skip
        self.margin, self.recheck = margin, recheck
        self.probes = self.moves = 0
        self.reset(q)

    def reset(self, q: float) -> None:
        """Start over from q (an operator or calibration set it)."""
        self.best, self.delta = q, self.delta0
        self.plan: list[float] = []           # the q values of the current round, in order
        self.times: list[float] = []          # their mean step seconds
        self.idle = 0                         # windows held since converging
        self._start_round()

    # -- the rounds ----------------------------------------------------------------------------
    def _start_round(self) -> None:
        qs = [self.best, max(0.0, self.best - self.delta), min(1.0, self.best + self.delta)]
        self.plan = list(dict.fromkeys(qs))      # clamped to 0..1; at an end, one probe
        self.times = []
        self._open(self.plan[0])

    def _open(self, q: float) -> None:
        self.current, self.batch, self.steps, self.seconds, self.skipped = q, None, 0, 0.0, 0

    @property
    def converged(self) -> bool:
        return self.delta < self.min_delta

    def observe(self, batch: int | None, seconds: float | None) -> float | None:
        """One decode step of ``batch`` sequences took ``seconds``. ``batch`` None: a step that is
        not a timed decode step (a prefill) came between, and the window starts over; ``seconds``
        None: this step is left out (a graph was captured in it). Returns the q to apply before
        the next step, or None."""
        if batch is None or (self.batch is not None and batch != self.batch):
            self.batch, self.steps, self.seconds = batch, 0, 0.0   # restart this window
            return None
        self.batch = batch
        if seconds is None:
            return None
        if self.skipped < self.skip:
            self.skipped += 1
            return None
        self.steps, self.seconds = self.steps + 1, self.seconds + seconds
        if self.steps < self.window:
            return None
        mean = self.seconds / self.steps
        if self.converged:                                      # holding: count windows until a recheck
            self.idle += 1
            self._open(self.current)
            self.skipped = self.skip
            if self.idle >= self.recheck:
                self.idle, self.delta = 0, 2 * self.min_delta
                self._start_round()
                return self.current if self.current != self.best else None
            return None
        self.times.append(mean)
        self.probes += 1
        if len(self.times) < len(self.plan):
            self._open(self.plan[len(self.times)])
            return self.current
        # a round is done: keep the best unless a probe beats it by the margin
        base = self.times[0]
        i = min(range(len(self.times)), key=self.times.__getitem__)
        if i > 0 and self.times[i] < base * (1.0 - self.margin):
            log.info("split tuner: q %.3f -> %.3f (step %.2f -> %.2f ms at batch %d)", self.best, self.plan[i],
                     1e3 * base, 1e3 * self.times[i], batch)
            self.best = self.plan[i]
            self.moves += 1
        else:
            self.delta /= 2.0
        if self.converged:
            self._open(self.best)
            self.skipped = 0
            return self.best
        self._start_round()
        return self.current

    def stats(self) -> dict:
        return {"fill_fraction": self.best, "delta": self.delta, "converged": self.converged,
                "probes": self.probes, "moves": self.moves}


def decode_batch(chunks) -> int | None:
    """The batch size of a pure decode step (one new token per sequence), else None."""
    if chunks and all(len(c.tokens) == 1 for c in chunks):
        return len(chunks)
    return None

