"""The q* rule: how many of a step's m cache misses to fill over PCIe.

With fill fraction f = B_pcie / (B_pcie + B_cpu) (from calibration), filling q experts takes
q * S / B_pcie and computing the other m - q on the CPU takes (m - q) * S / B_cpu; the two run
at once, so the step waits for the larger. In units of S / B_pcie the two sides are q and
(m - q) * f / (1 - f). The real optimum f * m is rarely an integer: take whichever of its floor
and ceiling gives the smaller of the two maxima (ties: fill more, since filled experts stay
cached for later steps).

With the streamed split (``kernels/triton/stream.py``) the CPU side is divisible: any q <= f m
then takes the ideal m S / (B_pcie + B_cpu), since streamed rows balance the rest, while a q
above f m is PCIe-bound. ``fills_for(m, f, floor=True)`` is that rule's q: floor(f m), the most
fills that still leave no layer waiting for PCIe.
"""
from __future__ import annotations

import math


def fills_for(m: int, f: float, floor: bool = False) -> int:
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"fill_fraction must be in [0, 1], got {f}")
    if m <= 0 or f <= 0.0:
        return 0
    if f >= 1.0:
        return m
    if floor:
        return math.floor(f * m + 1e-9)
    ratio = f / (1.0 - f)
    lo, hi = math.floor(f * m), min(math.ceil(f * m), m)

    def cost(q: int) -> float:
        return max(q, (m - q) * ratio)

    return hi if cost(hi) <= cost(lo) else lo
