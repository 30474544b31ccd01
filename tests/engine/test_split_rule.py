"""The q* rule (kernels/split.py): how many of a layer call's misses cross PCIe, with and without
the CPU's call-size speed curve."""
from __future__ import annotations

import pytest

from freetoken_engine.kernels.split import MAX_SPEED, check_speed, fills_for, speed_curve


@pytest.mark.parametrize("f", [0.05, 0.3, 0.339, 0.5, 0.61, 0.9])
def test_a_flat_speed_curve_gives_the_floor_or_ceiling_rule(f):
    """Every call size at the one-expert rate: the same q as the rule without a curve, 0-64 misses."""
    for curve in [(1.0,), (1.0,) * 8]:
        assert [fills_for(m, f, speed=curve) for m in range(65)] == [fills_for(m, f) for m in range(65)]


def test_a_faster_cpu_on_larger_calls_takes_more_of_the_misses():
    """Qwen3.6's experts on the H100 host: 1-expert calls at 91.7 GB/s beside the fills, 8-expert
    calls at 111 (stop 66's bandwidths). A layer call of 8 misses then fills 2, not 3: the
    CPU's 6 take 6 * 0.513 / 1.21 = 2.54 units of PCIe time against 3 fills' 3."""
    curve = speed_curve({1: 91.7, 2: 100.0, 4: 108.0, 8: 111.0})
    f = 0.339
    assert fills_for(8, f) == 3 and fills_for(8, f, speed=curve) == 2
    for m in range(1, 65):       # never more fills than the flat rule, and the step never slower
        q, q0 = fills_for(m, f, speed=curve), fills_for(m, f)
        assert q <= q0

        def step(q):
            c = m - q
            return max(q, c * f / (1 - f) / curve[min(c, 8) - 1] if c else 0.0)
        assert step(q) <= step(q0) + 1e-12
        assert step(q) == min(step(x) for x in range(m + 1))


def test_speed_curve_interpolates_and_never_falls():
    curve = speed_curve({1: 100.0, 2: 120.0, 4: 110.0, 8: 150.0}, longest=10)
    assert curve[0] == 1.0 and curve[1] == 1.2
    assert curve[2] == 1.2 and curve[3] == 1.2           # 4 measured slower than 2: kept at 2's
    assert curve[5] == pytest.approx(1.3)                # halfway between 4 (1.1) and 8 (1.5)
    assert curve[7:] == (1.5, 1.5, 1.5)                  # beyond the largest measured size
    assert speed_curve({1: 10.0, 2: 100.0})[1] == MAX_SPEED
    with pytest.raises(ValueError, match="one-expert"):
        speed_curve({2: 100.0})


@pytest.mark.parametrize("bad", [[], [1.2, 1.3], [1.0, 0.9], [1.0, 1.5, 1.4], [1.0, MAX_SPEED + 1]])
def test_a_speed_curve_out_of_shape_is_refused(bad):
    with pytest.raises(ValueError, match="speed curve"):
        check_speed(bad)
    assert check_speed([1.0, 1.5]) == (1.0, 1.5) and check_speed(None) is None
