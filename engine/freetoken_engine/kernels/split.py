"""The q* rule: how many of a step's m cache misses to fill over PCIe.

With fill fraction f = B_pcie / (B_pcie + B_cpu) (from calibration), filling q experts takes
q * S / B_pcie and computing the other m - q on the CPU takes (m - q) * S / B_cpu; the two run
at once, so the step waits for the larger. In units of S / B_pcie the two sides are q and
(m - q) * f / (1 - f). The real optimum f * m is rarely an integer: take whichever of its floor
and ceiling gives the smaller of the two maxima (ties: fill more, since filled experts stay
cached for later steps).

The CPU's rate depends on how many experts one call computes: a call's fixed costs (waking the
kernel's workers, their last partial chunk) weigh less when it has more rows to share out. The
calibration's B_cpu is the rate of one-expert calls; ``speed[n - 1]`` is the rate of an n-expert
call over that (``speed[0] == 1``; calls of more experts than ``speed`` lists take its last
entry), measured on the model's own experts (``ExpertBank.cpu_call_speed``). The CPU side of q
fills is then (m - q) * f / (1 - f) / speed(m - q), and q is the one of 0..m with the smaller
maximum (ties: fill more). With every speed 1 that is the floor-or-ceiling rule above.

With the streamed split (``kernels/triton/stream.py``) the CPU side is divisible: any q <= f m
then takes the ideal m S / (B_pcie + B_cpu), since streamed rows balance the rest, while a q
above f m is PCIe-bound. ``fills_for(m, f, floor=True)`` is that rule's q: floor(f m), the most
fills that still leave no layer waiting for PCIe (the speed curve does not apply there).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

#: a call-size speed outside [1, MAX_SPEED] is not trusted (a measurement spoilt by another process)
MAX_SPEED = 4.0


def check_speed(speed: Sequence[float] | None) -> tuple[float, ...] | None:
    """``speed`` as a tuple, or ValueError: speed[0] == 1, every entry within [1, MAX_SPEED] and
    none below the one before (a larger call never computes an expert slower). None: no curve."""
    if speed is None:
        return None
    s = tuple(float(v) for v in speed)
    if not s or s[0] != 1.0:
        raise ValueError(f"a CPU call-size speed curve starts at 1.0 (one-expert calls), got {list(s)}")
    if any(not 1.0 <= v <= MAX_SPEED for v in s) or any(b < a for a, b in zip(s, s[1:])):
        raise ValueError(f"a CPU call-size speed curve is non-decreasing within [1, {MAX_SPEED}], got {list(s)}")
    return s


def fills_for(m: int, f: float, floor: bool = False, speed: Sequence[float] | None = None) -> int:
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"fill_fraction must be in [0, 1], got {f}")
    if m <= 0 or f <= 0.0:
        return 0
    if f >= 1.0:
        return m
    if floor:
        return math.floor(f * m + 1e-9)
    ratio = f / (1.0 - f)
    if speed:
        best, best_cost = m, float(m)
        for q in range(m - 1, -1, -1):      # descending: a tie keeps the larger q (fill more)
            c = m - q
            cost = max(q, c * ratio / speed[min(c, len(speed)) - 1])
            if cost < best_cost:
                best, best_cost = q, cost
        return best
    lo, hi = math.floor(f * m), min(math.ceil(f * m), m)

    def cost(q: int) -> float:
        return max(q, (m - q) * ratio)

    return hi if cost(hi) <= cost(lo) else lo


def speed_curve(rates: dict[int, float], longest: int = 8) -> tuple[float, ...]:
    """A call-size speed curve for calls of 1..``longest`` experts from measured rates (GB/s by
    experts per call; needs 1): each over the one-expert rate, linear between measured sizes,
    the last measured beyond, made non-decreasing and kept within [1, MAX_SPEED]."""
    if rates.get(1, 0.0) <= 0.0:
        raise ValueError(f"a speed curve needs the rate of one-expert calls, got {rates}")
    sizes = sorted(n for n, r in rates.items() if n >= 1 and r > 0.0)
    curve, top = [], 1.0
    for n in range(1, longest + 1):
        lo = max(s for s in sizes if s <= n)
        hi = min((s for s in sizes if s >= n), default=lo)
        r = rates[lo] if hi == lo else rates[lo] + (rates[hi] - rates[lo]) * (n - lo) / (hi - lo)
        top = min(MAX_SPEED, max(top, r / rates[1]))
        curve.append(top)
    curve[0] = 1.0
    return tuple(round(v, 4) for v in curve)
