"""q* by the CPU's measured rate (executor/cpu_contention.py): on the model's own experts from the
start, and while another process holds some of the CPU kernel's CPUs, when the split sends more
misses over PCIe, giving them back when the process ends. The logic runs against a scripted pool record and clock; the
whole chain (the pool's record, the probe on a real bank, a busy process on a worker's CPU) runs
on this machine's CPUs."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cpu_bank_cases import bank_experts, two_kernel_workers
from freetoken_engine.executor.cpu_contention import (ContentionFollower, FollowConfig, contended_fraction,
                                                      pool_record)


@pytest.fixture
def two_workers():
    with two_kernel_workers():
        yield


CFG = FollowConfig(period_s=1.0, enter_ticks=2, leave_ticks=3, remeasure_s=10.0, margin=0.1, min_share=0.5,
                   min_jobs=32, probe_s=0.2)


@pytest.mark.parametrize("f", [0.2, 0.364, 0.7])
@pytest.mark.parametrize("r", [0.25, 0.5, 1.0])
def test_the_contended_split_balances_the_step(f, r):
    """f = P / (P + C) balanced fills (over P) against CPU experts (at C); with the CPU at r C the
    new split makes both sides take the same time again."""
    pcie, cpu = 1.0, (1 - f) / f
    g = contended_fraction(f, r)
    assert g / pcie == pytest.approx((1 - g) / (r * cpu))
    assert (g > f) == (r < 1.0)
    assert contended_fraction(1.0, r) == 1.0          # no CPU share to move


class Pool:
    """A scripted pool record, clock and CPU rate."""

    def __init__(self, rate=100.0):
        self.now, self.rate, self.rec, self.probes = 0.0, rate, {
            "workers_left_out": 0, "stalled_calls": 0, "jobs": 0, "entered": [0, 0]}, 0

    def stats(self):
        return dict(self.rec, entered=list(self.rec["entered"]))

    def probe(self, seconds):
        self.probes += 1
        return self.rate

    def jobs(self, n, shares=(1.0, 1.0)):
        self.rec["jobs"] += n
        self.rec["entered"] = [e + round(s * n) for e, s in zip(self.rec["entered"], shares)]

    def follower(self, base=0.4, cfg=CFG, calibrated=None):
        return ContentionFollower(base, self.stats, self.probe, calibrated, cfg=cfg, clock=lambda: self.now)

    def look(self, f, **kw):
        """One period later, after some decode jobs (scripted by kw), a look; its answer."""
        self.now += f.cfg.period_s
        self.jobs(100, **kw)
        return f.tick()


def test_one_hiccup_changes_nothing():
    p = Pool()
    f = p.follower()
    assert p.probes == 1 and f.reference == 100.0
    p.rec["stalled_calls"] += 1                        # one call waited for a descheduled worker once
    assert p.look(f) is None
    assert [p.look(f) for _ in range(5)] == [None] * 5
    assert p.probes == 1 and not f.active


def test_sustained_contention_moves_the_split_towards_pcie_and_back():
    p = Pool()
    f = p.follower(base=0.4)
    p.rate = 40.0                                       # another process: the CPU at 40%
    p.rec["workers_left_out"] = 1
    assert p.look(f) is None                           # one look is not enough
    q = p.look(f)
    assert q == pytest.approx(contended_fraction(0.4, 0.4)) and q > 0.6
    assert f.active and f.state()["cpu_rate_ratio"] == 0.4 and p.probes == 2
    assert [p.look(f) for _ in range(9)] == [None] * 9  # no new measurement before remeasure_s
    assert p.probes == 2
    p.rate = 20.0                                       # more of the CPUs taken
    assert p.look(f) == pytest.approx(contended_fraction(0.4, 0.2))
    assert p.probes == 3
    p.rec["workers_left_out"] = 0                       # the process ends
    assert p.look(f) is None and p.look(f) is None
    assert p.look(f) == 0.4
    assert not f.active and f.effective() == 0.4 and f.episodes == 1


def test_a_worker_crowded_out_of_jobs_is_contention_without_any_stall():
    """A worker sharing its CPU with a busy process takes part in few jobs; nothing stalls."""
    p = Pool()
    f = p.follower(base=0.3)
    p.rate = 50.0
    assert p.look(f, shares=(1.0, 0.6)) is None and p.look(f, shares=(1.0, 0.6)) is None   # 60%: fine
    assert p.look(f, shares=(1.0, 0.2)) is None
    assert p.look(f, shares=(1.0, 0.2)) == pytest.approx(contended_fraction(0.3, 0.5))
    g = Pool()
    f = g.follower()
    g.rate = 50.0
    for _ in range(4):                                  # too few jobs in a look to judge shares
        g.now += 1.0
        g.jobs(20, shares=(1.0, 0.0))
        assert f.tick() is None
    assert g.probes == 1


def test_contention_that_leaves_the_rate_intact_costs_one_probe_per_remeasure():
    p = Pool()
    f = p.follower()
    p.rec["workers_left_out"] = 1
    p.rate = 95.0                                       # within the margin: nothing to move
    answers = [p.look(f) for _ in range(12)]
    assert answers == [None] * 12 and not f.active
    assert p.probes == 1 + 2                            # at the second look, then remeasure_s later


def test_a_new_calibration_while_contended_keeps_the_contention():
    p = Pool()
    f = p.follower(base=0.4)
    p.rate, p.rec["workers_left_out"] = 50.0, 1
    p.look(f)
    p.look(f)
    assert f.rebase(0.3) == pytest.approx(contended_fraction(0.3, 0.5))
    p.rec["workers_left_out"] = 0
    assert [p.look(f) for _ in range(3)][-1] == 0.3


def test_ticks_closer_than_the_period_do_not_look():
    p = Pool()
    f = p.follower()
    calls = []
    f._stats = lambda: calls.append(1) or p.stats()
    p.now += 1.0
    f.tick()
    for _ in range(10):
        p.now += 0.05
        f.tick()
    assert len(calls) == 1


def test_a_start_beside_a_busy_process_uses_that_rate_until_a_quiet_measurement_beats_it():
    """The engine starts beside a busy process: its reference (the pool's record shows the other
    process meanwhile) is what the CPU does now, so the split starts from it; once the looks are
    quiet it measures again, and the faster rate becomes the reference and the model's rate."""
    p = Pool(rate=30.0)

    def crowded_probe(seconds):                         # the reference's own jobs show the crowding
        p.jobs(200, shares=(1.0, 0.1))
        return Pool.probe(p, seconds)

    f = ContentionFollower(0.4, p.stats, crowded_probe, 100.0, cfg=CFG, clock=lambda: p.now)
    assert f.reference == 30.0 and f.reference_contended and f.model_ratio == 0.3
    assert f.effective() == pytest.approx(contended_fraction(0.4, 0.3))
    assert [p.look(f, shares=(1.0, 0.1)) for _ in range(5)] == [None] * 5   # the same rate: nothing moves
    p.rate, f._probe = 80.0, p.probe                    # the process ends
    got = [q for q in (p.look(f) for _ in range(12)) if q is not None]
    assert got == [pytest.approx(contended_fraction(0.4, 0.8))]
    assert f.reference == 80.0 and not f.reference_contended and f.model_ratio == 0.8
    probes = p.probes
    assert [p.look(f) for _ in range(30)] == [None] * 30 and p.probes == probes   # quiet: no more probes
    p.rate, p.rec["workers_left_out"] = 24.0, 1
    p.look(f)
    assert p.look(f) == pytest.approx(contended_fraction(0.4, 0.8 * 0.3))


# -- the whole chain on this machine's CPUs ---------------------------------------------------------

def _until(follower, experts, want, seconds=15.0):
    """Decode-like kernel work and a look, until the follower answers ``want(q)``; that q."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        experts.cpu_rate(0.02)
        q = follower.tick()
        if q is not None and want(q):
            return q
    raise AssertionError(f"no answer in {seconds} s; state {follower.state()}, pool {pool_record()}")


@pytest.mark.quiet_cpu
def test_a_busy_process_on_a_workers_cpu_moves_the_split_and_its_end_moves_it_back(two_workers):
    """The kernel's worker pinned to the last CPU shares it with a busy-looping process: it takes
    part in few jobs (nothing stalls: the caller takes its chunks), the CPU computes experts
    slower (about half the rate on a 2-CPU machine), and the split moves towards PCIe by what the
    probe measured; when the process ends it returns to the calibrated one."""
    experts = bank_experts()
    cfg = FollowConfig(period_s=0.1, enter_ticks=2, leave_ticks=5, remeasure_s=60.0, probe_s=0.1)
    last = max(os.sched_getaffinity(0))
    for attempt in range(2):    # the VM's host held a CPU while the reference or the return was measured: once more
        follower = ContentionFollower(0.4, pool_record, experts.cpu_rate, cfg=cfg)
        assert follower.reference and follower.reference > 0
        hog = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{last}}})\nwhile True: pass"])
        try:
            q = _until(follower, experts, lambda q: q > 0.4)
        except AssertionError:
            if attempt:
                raise
            continue
        finally:
            hog.kill()
            hog.wait()
        assert follower.active and follower.ratio < 1 - cfg.margin
        assert q == pytest.approx(contended_fraction(0.4, follower.ratio))
        try:
            back = _until(follower, experts, lambda q: q == 0.4)
        except AssertionError:
            if attempt:
                raise
            continue
        assert back == 0.4 and not follower.active and follower.episodes == 1
        break


def test_a_rate_above_the_reference_becomes_the_reference():
    """A reference taken on a slow moment is raised by a faster measurement, so a later
    contention is judged against what the CPU can do."""
    p = Pool(rate=80.0)
    f = p.follower(base=0.4)
    p.rate, p.rec["workers_left_out"] = 100.0, 1
    assert p.look(f) is None and p.look(f) is None
    assert f.reference == 100.0 and not f.active
    p.rate = 50.0
    for _ in range(10):
        q = p.look(f)
    assert q == pytest.approx(contended_fraction(0.4, 0.5))


def test_looks_before_an_idle_spell_do_not_count_after_it():
    """One contended look, the engine idle for a minute (no steps, no looks), one more contended
    look: two looks, but not in a row of the engine's work, so no measurement yet."""
    p = Pool()
    f = p.follower()
    p.rate, p.rec["workers_left_out"] = 40.0, 1
    assert p.look(f) is None
    p.now += 60.0
    assert p.look(f) is None and p.probes == 1
    assert p.look(f) is not None


def test_a_model_whose_experts_the_cpu_computes_slower_gets_more_fills():
    """The calibration's C comes from 9.4 MB experts; the CPU computes this model's at half that
    rate (the reference on its bank): the split starts from f for r = 0.5, and contention
    multiplies on top of it."""
    p = Pool(rate=50.0)
    f = p.follower(base=0.4, calibrated=100.0)
    assert f.model_ratio == 0.5
    assert f.effective() == pytest.approx(contended_fraction(0.4, 0.5))
    p.rate, p.rec["workers_left_out"] = 25.0, 1
    p.look(f)
    assert p.look(f) == pytest.approx(contended_fraction(0.4, 0.25))
    p.rec["workers_left_out"] = 0
    assert [p.look(f) for _ in range(3)][-1] == pytest.approx(contended_fraction(0.4, 0.5))
    assert f.rebase(0.3) == pytest.approx(contended_fraction(0.3, 0.5))
    assert Pool(rate=1e4).follower(calibrated=100.0).model_ratio == 4.0      # trusted within 4x


class _GpuService:
    """What a GPU engine's service reports to the metrics collector (this machine has no GPU)."""

    def __init__(self, follow):
        self.follow, self.model_name = follow, "m"

    def health(self):
        return {"status": "ok"}

    def stats(self):
        return {}

    def cache_stats(self):
        return {"expert_cache": {"fill_fraction": 0.62, "cpu_contention": self.follow}}


@pytest.mark.parametrize("follow", [None, {"active": True, "cpu_rate_ratio": 0.4}])
def test_the_cpu_rate_ratio_is_exported_where_the_split_follows_it(follow):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from freetoken_engine.metrics import EngineMetrics
    text = generate_latest(EngineMetrics(_GpuService(follow), "m").registry).decode()
    fams = {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.samples}
    assert fams["freetoken_expert_fill_fraction"] == 0.62
    assert fams.get("freetoken_cpu_rate_ratio") == (follow["cpu_rate_ratio"] if follow else None)


def test_a_rate_measured_before_needs_no_probe_at_start():
    """A restart reads the model's rate from this host's cache: no probe at start (so the bank's
    read can overlap the graph warm-up), and contention is judged against that rate."""
    p = Pool(rate=50.0)
    f = ContentionFollower(0.4, p.stats, p.probe, 100.0, cfg=CFG, clock=lambda: p.now, reference=60.0)
    assert p.probes == 0 and f.reference == 60.0 and f.model_ratio == 0.6 and not f.reference_contended
    assert f.effective() == pytest.approx(contended_fraction(0.4, 0.6))
    p.rate, p.rec["workers_left_out"] = 30.0, 1
    p.look(f)
    assert p.look(f) == pytest.approx(contended_fraction(0.4, 0.6 * 0.5))
