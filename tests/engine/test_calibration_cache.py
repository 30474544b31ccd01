"""The engine's q* calibration is cached per host configuration, and the CPU expert kernel's own
settings are part of it: giving the kernel fewer CPUs (or another backend) changes B_cpu, so the
cached q* measured with the old settings must not be reused."""
from __future__ import annotations

import pytest
import torch

from freetoken_engine import calibrate


def test_changing_the_kernel_threads_or_backend_recalibrates(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path))
    for name in ("FREETOKEN_CPU_EXPERT_THREADS", "FREETOKEN_CPU_EXPERT_BACKEND", "FREETOKEN_CPU_KERNEL"):
        monkeypatch.delenv(name, raising=False)
    measured = []

    def fake_measure(device="cpu", seconds=1.0):
        measured.append(device)
        return {"fill_fraction": 1.0, "cpu_expert_gbps": float(len(measured))}

    monkeypatch.setattr(calibrate, "measure", fake_measure)
    cpu = torch.device("cpu")
    first = calibrate.load_or_measure(cpu)
    assert calibrate.load_or_measure(cpu) == first and len(measured) == 1        # cached
    monkeypatch.setenv("FREETOKEN_CPU_EXPERT_THREADS", "1")
    assert calibrate.load_or_measure(cpu)["cpu_expert_gbps"] == 2.0               # other threads: measured
    monkeypatch.setenv("FREETOKEN_CPU_EXPERT_BACKEND", "reference")
    assert calibrate.load_or_measure(cpu)["cpu_expert_gbps"] == 3.0               # other backend: measured
    monkeypatch.delenv("FREETOKEN_CPU_EXPERT_THREADS")
    monkeypatch.delenv("FREETOKEN_CPU_EXPERT_BACKEND")
    assert calibrate.load_or_measure(cpu) == first and len(measured) == 3        # back: the first entry


def test_a_measurement_taken_beside_another_process_is_used_but_not_cached(tmp_path, monkeypatch):
    """B_cpu measured while another process held the kernel's CPUs (stalled calls) describes
    the host only while that process runs: load_or_measure returns it, caches nothing, and the
    next start measures again, caching a quiet one (one stalled call, a hiccup, does not count)."""
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path))
    results = iter([{"fill_fraction": 1.0, "cpu_expert_gbps": 5.0, "cpu_stalled_calls": 6, "cpu_contended": True},
                    {"fill_fraction": 1.0, "cpu_expert_gbps": 40.0, "cpu_stalled_calls": 1, "cpu_contended": False}])
    monkeypatch.setattr(calibrate, "measure", lambda device="cpu", seconds=1.0: next(results))
    cpu = torch.device("cpu")
    assert calibrate.load_or_measure(cpu)["cpu_expert_gbps"] == 5.0
    assert not calibrate.calibrated(cpu)
    assert calibrate.load_or_measure(cpu)["cpu_expert_gbps"] == 40.0
    assert calibrate.calibrated(cpu) and calibrate.load_or_measure(cpu)["cpu_expert_gbps"] == 40.0


@pytest.mark.quiet_cpu
def test_measure_reports_contention_when_a_worker_keeps_holding_calls_up():
    """The real measurement counts the calls a worker held up (made to, with the pool's test knob,
    every time it comes back from a short time-out) and calls the result contended. (That a quiet
    measurement is not contended depends on the machine being quiet, so it is not asserted.)"""
    from freetoken_engine.kernels import cpu_experts as ce
    if not ce.available():
        pytest.skip("compiled kernel unavailable")
    cfg, knobs = ce.configure(), ce.tune()
    try:
        ce.configure(threads=2, spin_us=200_000)
        ce.tune(test_stall_us=20_000, stall_us=2_000, backoff_ms=20, backoff_max_ms=20)
        results = [calibrate.measure("cpu", seconds=0.5) for _ in range(3)]
        assert any(r["cpu_contended"] and r["cpu_stalled_calls"] >= calibrate.CONTENDED_STALLS for r in results), \
            [r["cpu_stalled_calls"] for r in results]
    finally:
        ce.tune(**knobs)
        ce.configure(threads=cfg.threads, isa=cfg.isa, prefetch_bytes=cfg.prefetch_bytes, spin_us=cfg.spin_us)


def test_one_stalled_call_is_a_hiccup_three_are_contention(monkeypatch):
    """A worker descheduled once costs a few ms of a second's thousands of calls: the result is
    still cached. Three stalled calls mean a process keeps a CPU busy."""
    for stalls, contended in ((1, False), (calibrate.CONTENDED_STALLS, True)):
        counts = iter([10, 10 + stalls])
        monkeypatch.setattr(calibrate, "_stalled_calls", lambda: next(counts))
        result = calibrate.measure("cpu", seconds=0.05)
        assert (result["cpu_stalled_calls"], result["cpu_contended"]) == (stalls, contended)
