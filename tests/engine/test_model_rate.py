"""The engine's start of the q* follower (executor/model_rate.py): the CPU's rate on the model's
experts and its curve by call size, measured on a real bank and kernel or read from this host's
cache (calibrate.py)."""
from __future__ import annotations

import pytest
import torch

from cpu_bank_cases import bank_experts, two_kernel_workers
from freetoken_engine.executor.cpu_contention import contended_fraction


@pytest.fixture
def two_workers():
    with two_kernel_workers():
        yield


def test_the_models_rate_is_cached_per_host_and_expert_shape(tmp_path, monkeypatch):
    from freetoken_engine import calibrate
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path))
    assert calibrate.cached_model_rate("cpu", "2048x768-bfloat16") is None
    calibrate.save_model_rate("cpu", "2048x768-bfloat16", 61.5)
    assert calibrate.cached_model_rate("cpu", "2048x768-bfloat16") == 61.5
    assert calibrate.cached_call_speed("cpu", "2048x768-bfloat16") is None      # saved without a curve
    calibrate.save_model_rate("cpu", "2048x768-bfloat16", 61.5, (1.0, 1.2, 1.3))
    assert calibrate.cached_call_speed("cpu", "2048x768-bfloat16") == (1.0, 1.2, 1.3)
    assert calibrate.cached_model_rate("cpu", "1024x384-bfloat16") is None       # another shape
    [path] = tmp_path.glob("calibration/*-expert-rate-2048x768-bfloat16.json")
    path.write_text('{"cpu_expert_gbps": 61.5, "cpu_call_speed": [1.0, 0.5]}')
    assert calibrate.cached_call_speed("cpu", "2048x768-bfloat16") is None      # out of shape: measure again
    path.write_text("{not json")
    assert calibrate.cached_model_rate("cpu", "2048x768-bfloat16") is None       # unreadable: measure again


class _Read:
    """A bank read still going (models.build.BankRead's pending / finish)."""

    def __init__(self):
        self.pending, self.finished_at = True, None

    def finish(self):
        self.pending = False


def test_a_first_start_measures_after_the_read_and_a_restart_reads_the_cache(two_workers, tmp_path, monkeypatch):
    """The runner's start of the follower (ModelRunner._start_follower) on a real bank and kernel,
    as on a GPU host (which this machine is not: the runner's device reads cuda, and the host
    cache's path, which names the GPU, is a temporary file): a first start finishes the bank's
    read, probes and caches the rate, and moves q* by it; a restart takes the cached rate, probes
    nothing and leaves the read running (the graph warm-up overlaps it). A rate probed while the
    pool's record shows another process on the CPUs is used but not cached, so the next start
    probes again. The record is given here (the real one is the subject of the busy-process tests
    above): on this shared 2-CPU VM the host's other tenants made 8 real probes in a row read as
    contended in a clean-clone run."""
    import types

    from freetoken_engine import calibrate
    from freetoken_engine.config import EngineConfig
    from freetoken_engine.executor import model_rate
    from freetoken_engine.executor.runner import ModelRunner
    monkeypatch.setattr(calibrate, "_cache_path", lambda device: tmp_path / "host.json")
    record = {"workers_left_out": 1}                 # another process on a worker's CPU
    monkeypatch.setattr(model_rate, "pool_record", lambda: dict(record))
    experts = bank_experts()
    probes, curves = [], []
    rate, curve = experts.cpu_rate, experts.bank.cpu_call_speed

    def counted(seconds):
        probes.append(seconds)
        return rate(seconds)

    def counted_curve(seconds, **kw):
        curves.append(curve(seconds, **kw))
        return curves[-1]

    monkeypatch.setattr(experts, "cpu_rate", counted)
    monkeypatch.setattr(experts.bank, "cpu_call_speed", counted_curve)

    def start():
        runner = types.SimpleNamespace(cache=types.SimpleNamespace(fill_fraction=0.4, cpu_speed=None), bank=experts.bank,
                                       experts=experts, device=torch.device("cuda"), tuner=None,
                                       _calibrated_gbps=60.0, follower=None, set_to=[])
        runner._set_q = runner.set_to.append
        read = _Read()
        ModelRunner._start_follower(runner, EngineConfig(model=tmp_path, device="cuda"), read)
        return runner, read

    busy, read = start()
    assert not read.pending and len(probes) == 1 and busy.follower.reference_contended
    assert len(curves) == 1 and busy.cache.cpu_speed == curves[0]      # the fill table takes the curve
    assert busy.follower.reference > 0 and len(busy.set_to) == 1        # the split uses it ...
    assert calibrate.cached_model_rate("cuda", "1024x512-bfloat16") is None      # ... not kept
    record.clear()                                   # the other process is gone
    first, read = start()
    assert not read.pending and len(probes) == 2     # probed again
    f = first.follower
    assert not f.reference_contended
    assert f.model_ratio == pytest.approx(min(4.0, max(0.25, f.reference / 60.0))) and f.model_ratio != 1.0
    assert first.set_to == [pytest.approx(contended_fraction(0.4, f.model_ratio))]
    assert calibrate.cached_model_rate("cuda", "1024x512-bfloat16") == f.reference
    assert len(curves) == 2 and calibrate.cached_call_speed("cuda", "1024x512-bfloat16") == curves[1]
    assert len(curves[1]) == 8 and curves[1][0] == 1.0        # calls of 1-8 of the bank's 16 experts
    again, read = start()
    assert read.pending and len(probes) == 2 and len(curves) == 2       # nothing measured
    assert again.follower.reference == f.reference and again.set_to == first.set_to
    assert again.cache.cpu_speed == curves[1]


def test_the_curve_takes_a_one_expert_rate_just_measured_instead_of_timing_it_again(monkeypatch):
    bank = bank_experts().bank
    timed = []
    monkeypatch.setattr(bank, "_call_rate", lambda n, seconds: timed.append(n) or 50.0 * (1 + n / 10))
    assert bank.cpu_call_speed(0.01, sizes=(1, 2, 4), one=50.0)[:4] == (1.0, 1.2, 1.3, 1.4)
    assert timed == [2, 4]                            # the one-expert calls were not timed again
    bank.cpu_call_speed(0.01, sizes=(1, 2))
    assert timed[2:] == [1, 2]                        # without one, they are
