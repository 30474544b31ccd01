"""q* for this model's experts, and while another process holds some of the CPU kernel's CPUs.

The calibrated fill fraction f = P / (P + C) balances a decode step's PCIe fills against the
misses the CPU computes, with C the CPU kernel's rate (``calibrate.py``: one-expert calls from C
on Qwen3-30B-A3B-sized experts, 9.4 MB). When the CPU computes this model's experts at r times C,
the split that balances the step is

    f' = P / (P + r C) = f / (f + r (1 - f)),

which needs only f and r. Two things make r differ from 1, and both are measured with the same
loop of one-expert calls from C that the calibration times (``cpu_experts.calls_seconds``), here
on the model's own expert rows (``OffloadedExperts.cpu_rate``):

* the model: its experts' size (a call's fixed costs weigh more on small experts) and dtype. The
  engine measures the rate on its bank when it starts (the reference); ``model_ratio`` is the
  reference over the calibration's C. An engine started beside a busy process keeps what it
  measured then (what the CPU does meanwhile) and measures again once the pool's record is quiet;
  any later measurement above the reference raises it, and the model's ratio with it.
* another process keeping some of the kernel's CPUs busy (a game, a browser, a build): the CPU
  falls to ``ratio`` times its reference while it lasts, measured again when contention starts,
  not guessed from the number of workers left out (memory-bound calls do not scale with threads).

The follower notices contention from the pool's own record (``pool_record``, ``kernels/cpu/pool.h``):
a worker left out or a call that waited for one (a worker preempted inside a call), or a worker
that took part in fewer than ``min_share`` of the jobs since the last look (a worker sharing its
CPU with another process: the caller takes its chunks, so nothing stalls, and the rate falls all
the same). It measures after ``enter_ticks`` such looks in a row (one worker descheduled once is
a hiccup) and applies f' when the rate is below ``1 - margin`` of the reference; it measures again
every ``remeasure_s`` while the contention lasts (at most that often when a measurement finds the
rate intact, so a false alarm costs one ``probe_s`` per ``remeasure_s``), and gives the split back
after ``leave_ticks`` quiet looks. Looks happen only while the engine computes (a step calls
``tick``), at most one per ``period_s``.

Only the split changes: where an expert is computed never changes its value (the CPU and GPU paths
agree within the tolerance tested in tests/gpu), so the follower changes speed, not output.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)
#: the model's rate against the calibration's is trusted within this factor either way
MAX_MODEL_RATIO = 4.0


def pool_record() -> dict:
    """The CPU kernel pool's contention record and job shares (``cpu_experts.pool_stats`` and
    ``pool_entries``); {} while the compiled kernel is not loaded."""
    from ..kernels import cpu_experts
    return {**cpu_experts.pool_stats(), **cpu_experts.pool_entries()}


def contended_fraction(f: float, r: float) -> float:
    """The fill fraction that balances a step when the CPU runs at r times the rate f assumed."""
    if f >= 1.0 or r <= 0.0:
        return 1.0
    return f / (f + r * (1.0 - f))


@dataclass(frozen=True)
class FollowConfig:
    period_s: float = 0.5       # one look at the pool's record per this long, at most
    enter_ticks: int = 2        # contended looks in a row before measuring
    leave_ticks: int = 10       # quiet looks in a row before the calibrated split comes back
    remeasure_s: float = 30.0   # while contended: measure again this often
    margin: float = 0.1         # act when the CPU runs below 1 - margin of its reference
    min_share: float = 0.5      # a worker in fewer of the jobs since the last look is crowded out
    min_jobs: int = 32          # ... judged over at least this many jobs
    probe_s: float = 0.2        # length of one rate measurement


class ContentionFollower:
    """Decides the fill fraction from the calibrated one and the CPU's measured rate.

    ``stats()`` returns the pool's record (``pool_record``'s keys); ``probe(s)``
    the CPU kernel's GB/s over about s seconds. ``tick()`` returns a fill fraction to apply now,
    or None. Single-threaded: the engine calls it between steps."""

    def __init__(self, base: float, stats: Callable[[], dict], probe: Callable[[float], float],
                 calibrated_gbps: float | None = None, cfg: FollowConfig = FollowConfig(),
                 clock: Callable[[], float] = time.monotonic, reference: float | None = None):
        """``reference``: the rate measured on these experts before (a restart: no probe now)."""
        self.base, self.cfg, self._stats, self._probe, self._clock = base, cfg, stats, probe, clock
        self.calibrated_gbps = calibrated_gbps  # the calibration's C, behind base
        self.model_ratio = 1.0      # this model's reference rate over C (1 until a reference)
        self.ratio = 1.0            # the CPU's rate now over its reference, while active
        self.active = False
        self.episodes = 0           # contention periods acted on
        self.measurements = 0
        self._busy = self._quiet = 0
        self._last_tick = self._measured_at = None
        self.reference = 0.0        # the best rate measured on the model's experts
        self.reference_contended = False   # ... and another process was on the CPUs meanwhile
        if reference:
            self._seen = self._stats()
            self._raise_reference(reference)
        else:
            self._take_reference()
        self._measured_at = None    # the start's measurement does not delay the first contention's

    # -- the pool's record and the CPU's rate -----------------------------------------------------
    def _contended(self) -> bool:
        """Whether the pool's record shows another process on the kernel's CPUs since the last look."""
        now, was = self._stats(), self._seen
        self._seen = now
        if now.get("workers_left_out", 0) > 0 or now.get("stalled_calls", 0) > was.get("stalled_calls", 0):
            return True
        jobs = now.get("jobs", 0) - was.get("jobs", 0)
        if jobs < self.cfg.min_jobs:
            return False
        entered = now.get("entered") or []
        before = was.get("entered") or [0] * len(entered)
        return any((e - b) / jobs < self.cfg.min_share for e, b in zip(entered, before))

    def _rate(self) -> float:
        self.measurements += 1
        self._measured_at = self._clock()
        return self._probe(self.cfg.probe_s)

    def _raise_reference(self, rate: float) -> None:
        if rate > self.reference:
            self.reference = rate
            if self.calibrated_gbps:
                self.model_ratio = min(MAX_MODEL_RATIO, max(1 / MAX_MODEL_RATIO, rate / self.calibrated_gbps))

    def _take_reference(self) -> None:
        """The CPU's rate on the model's experts. Measured while the pool's record shows another
        process on the CPUs (an engine started beside a game), it is still what the CPU does now
        and the split uses it; it is measured again after ``leave_ticks`` quiet looks (at most once
        per ``remeasure_s``) until a measurement shows no other process."""
        self._seen = self._stats()
        rate = self._rate()
        self.reference_contended = self._contended()
        self._raise_reference(rate)

    def _measure(self) -> float:
        """The CPU's rate now; a rate above the reference (taken on a slow moment) raises it."""
        rate = self._rate()
        self._raise_reference(rate)
        return rate

    # -- decisions --------------------------------------------------------------------------------
    def effective(self) -> float:
        """The fill fraction in force: the calibrated one for this model's rate, and for the
        contention while it lasts."""
        return contended_fraction(self.base, self.model_ratio * (self.ratio if self.active else 1.0))

    def rebase(self, base: float) -> float:
        """A new calibrated fraction (an operator, the node agent); returns the one to apply."""
        self.base = base
        return self.effective()

    def tick(self) -> float | None:
        now, c = self._clock(), self.cfg
        if self._last_tick is not None and now - self._last_tick < c.period_s:
            return None
        if self._last_tick is not None and now - self._last_tick > c.leave_ticks * c.period_s:
            self._busy = self._quiet = 0         # idle meanwhile: what was seen then is stale
        self._last_tick = now
        contended = self._contended()
        self._busy, self._quiet = (self._busy + 1, 0) if contended else (0, self._quiet + 1)
        if not self.active:
            retry = self._measured_at is None or now - self._measured_at >= c.remeasure_s
            if self._busy >= c.enter_ticks and retry:
                return self._update(entering=True)
            if self.reference_contended and self._quiet >= c.leave_ticks and retry:
                before = self.effective()
                self._take_reference()
                self._quiet = 0
                return self._changed(before)
            return None
        if self._quiet >= c.leave_ticks:
            before, self.active, self.ratio = self.effective(), False, 1.0
            log.info("CPU contention over: fill fraction back to %.3f", self.effective())
            return self._changed(before)
        if self._busy and now - self._measured_at >= c.remeasure_s:
            return self._update(entering=False)
        return None

    def _update(self, entering: bool) -> float | None:
        before = self.effective()
        ratio = self._measure() / max(self.reference, 1e-9)
        if ratio >= 1.0 - self.cfg.margin:        # contended, but the kernel keeps its rate
            self.active, self.ratio = False, 1.0
        else:
            self.ratio, self.active = ratio, True
            self.episodes += entering
            log.info("CPU contention: the CPU kernel runs at %.0f%% of its rate; fill fraction %.3f -> %.3f",
                     100 * ratio, before, self.effective())
        return self._changed(before)

    def _changed(self, before: float) -> float | None:
        after = self.effective()
        return after if abs(after - before) > 1e-3 else None

    def state(self) -> dict:
        return {"active": self.active, "cpu_rate_ratio": round(self.ratio, 3),
                "model_rate_ratio": round(self.model_ratio, 3), "fill_fraction_calibrated": self.base,
                "episodes": self.episodes, "measurements": self.measurements}
