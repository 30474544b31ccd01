"""The online q* tuner (executor/split_tuner.py) against synthetic step-time curves."""
from __future__ import annotations

import random

import pytest

from freetoken_engine.cli import build_parser
from freetoken_engine.executor.split_tuner import SplitTuner
from freetoken_engine.server.serve import engine_config


def drive(tuner: SplitTuner, step_time, steps: int, batch=lambda i: 4, noise: float = 0.0, seed: int = 0):
    """Run ``steps`` decode steps; the step at fill fraction q takes step_time(q) (+ noise)."""
    rng, q, applied = random.Random(seed), tuner.current, []
    for i in range(steps):
        t = step_time(q) * (1.0 + noise * rng.uniform(-1, 1))
        new = tuner.observe(batch(i), t)
        if new is not None:
            q = new
            applied.append(new)
    return q, applied


def test_it_walks_to_the_fastest_split_and_holds_there():
    tuner = SplitTuner(0.45)
    q, applied = drive(tuner, lambda q: 10e-3 * (1 + 10 * (q - 0.28) ** 2), 3000, noise=0.003)
    assert tuner.converged and abs(tuner.best - 0.28) <= 0.05, tuner.stats()
    assert abs(q - tuner.best) < 1e-9                       # what runs is the best it found
    assert all(0.0 <= a <= 1.0 for a in applied)


def test_a_flat_curve_keeps_the_calibrated_split():
    tuner = SplitTuner(0.4)
    drive(tuner, lambda q: 5e-3, 2000, noise=0.01)
    assert tuner.best == pytest.approx(0.4) and tuner.moves == 0


def test_windows_that_change_batch_size_are_not_compared():
    """Every window is cut short by a batch change: nothing is measured, nothing moves."""
    tuner = SplitTuner(0.5)
    drive(tuner, lambda q: 1e-3 * (1 + 10 * q), 2000, batch=lambda i: 1 + (i // 10) % 3)
    assert tuner.probes == 0 and tuner.best == 0.5


def test_prefill_steps_between_decode_steps_restart_the_window():
    tuner = SplitTuner(0.5, window=8, skip=0)
    for _ in range(7):
        assert tuner.observe(4, 1e-3) is None
    assert tuner.observe(None, None) is None                # a prefill came between
    assert tuner.observe(4, None) is None                   # a step with a capture: left out
    for _ in range(7):
        tuner.observe(4, 1e-3)
    assert tuner.probes == 0
    tuner.observe(4, 1e-3)
    assert tuner.probes == 1


def test_it_stays_within_0_and_1_and_rechecks_after_converging():
    tuner = SplitTuner(0.02, recheck=4)
    q, applied = drive(tuner, lambda q: 1e-3 * (1 + 5 * q), 4000)
    assert min(applied) >= 0.0 and tuner.best == pytest.approx(0.0)
    assert tuner.probes > 3 * 5                              # it keeps probing after it converged


def test_reset_starts_over_from_the_operators_value():
    tuner = SplitTuner(0.6)
    drive(tuner, lambda q: 1e-3 * (1 + (q - 0.2) ** 2), 1500)
    tuner.reset(0.9)
    assert tuner.best == 0.9 and not tuner.converged and tuner.current == 0.9


def test_bad_start_is_refused():
    with pytest.raises(ValueError, match="within 0..1"):
        SplitTuner(1.5)


def test_serve_passes_the_decode_switches_to_the_engine(tmp_path):
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--no-cuda-graphs", "--split-tuning"])
    cfg = engine_config(args)
    assert cfg.cuda_graphs is False and cfg.split_tuning is True
    cfg = engine_config(build_parser().parse_args(["serve", "--model", str(tmp_path)]))
    assert cfg.cuda_graphs is True and cfg.split_tuning is False
