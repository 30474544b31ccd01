"""The engine's q* calibration is cached per host configuration, and the CPU expert kernel's own
settings are part of it: giving the kernel fewer CPUs (or another backend) changes B_cpu, so the
cached q* measured with the old settings must not be reused."""
from __future__ import annotations

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
