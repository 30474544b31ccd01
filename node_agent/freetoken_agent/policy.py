"""The pressure policy: how big every engine's expert cache should be right now.

A pure function of one observation and the state carried from the previous tick, so it is
tested table-driven without a GPU. The agent calls :func:`decide` every few hundred
milliseconds and applies ``Decision.targets`` through ``POST /admin/cache``.

Model (one memory domain: a GPU, or host RAM in CPU mode)::

    free      = total - used                       # what the node's owner can still take
    foreign   = used - ours                        # a game, a browser: not ours
    headroom  = max(headroom_bytes, headroom_fraction * total)
    room      = free - headroom                    # < 0: we must give memory back now

* Shrink at once: when ``free < headroom`` every cache shrinks, proportionally above its floor,
  by enough to restore the headroom (rounded to whole experts so the release is real).
* Never below a floor: an engine's floor is ``min_experts * expert_bytes``. When even all
  floors leave less than the headroom, ``memory_pressure`` is set so the operator can move a
  model away; the flag is recomputed every tick, so it clears when the pressure goes.
* Grow slowly: only when ``free > headroom + hysteresis``, ``cooldown_seconds`` after the last
  shrink and ``grow_interval_seconds`` after the last grow; each grow adds at most
  ``grow_step_fraction`` of an engine's maximum and leaves ``headroom + hysteresis`` free, so a
  grow can never by itself cause the next shrink.
* Host PSI (CPU mode only, where the cache lives in host RAM): ``some avg10`` above
  ``psi_shrink_threshold`` shrinks every cache by ``psi_shrink_fraction`` of its size above
  the floor, even when MemAvailable still looks fine (the kernel is already reclaiming).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the policy; validated on construction (``ValueError``)."""

    headroom_bytes: int = 1 * GiB
    headroom_fraction: float = 0.05
    hysteresis_bytes: int = 512 * MiB
    cooldown_seconds: float = 30.0
    grow_interval_seconds: float = 5.0
    grow_step_fraction: float = 0.25
    psi_shrink_threshold: float = 25.0
    psi_shrink_fraction: float = 0.25

    def __post_init__(self) -> None:
        if self.headroom_bytes < 0 or self.hysteresis_bytes < 0:
            raise ValueError("headroom_bytes and hysteresis_bytes must be >= 0")
        if not 0.0 <= self.headroom_fraction < 1.0:
            raise ValueError(f"headroom_fraction must be in [0, 1), got {self.headroom_fraction}")
        if self.cooldown_seconds < 0 or self.grow_interval_seconds < 0:
            raise ValueError("cooldown_seconds and grow_interval_seconds must be >= 0")
        if not 0.0 < self.grow_step_fraction <= 1.0:
            raise ValueError(f"grow_step_fraction must be in (0, 1], got {self.grow_step_fraction}")
        if not 0.0 < self.psi_shrink_fraction <= 1.0:
            raise ValueError(f"psi_shrink_fraction must be in (0, 1], got {self.psi_shrink_fraction}")

    def headroom(self, total_bytes: int) -> int:
        return max(self.headroom_bytes, int(self.headroom_fraction * total_bytes))


@dataclass(frozen=True)
class CacheState:
    """One engine's expert cache, as its ``GET /admin/cache`` reported it."""

    key: str
    capacity_bytes: int
    expert_bytes: int
    min_experts: int
    max_experts: int

    @property
    def floor_bytes(self) -> int:
        return self.min_experts * self.expert_bytes

    @property
    def max_bytes(self) -> int:
        return self.max_experts * self.expert_bytes


@dataclass(frozen=True)
class Observation:
    """One reading of a memory domain. ``ours_bytes`` counts every byte our engines hold there."""

    now: float
    total_bytes: int
    used_bytes: int
    ours_bytes: int
    caches: tuple[CacheState, ...] = ()
    psi_some_avg10: float | None = None  # only set when the caches live in host RAM

    @property
    def free_bytes(self) -> int:
        return max(0, self.total_bytes - self.used_bytes)

    @property
    def foreign_bytes(self) -> int:
        return max(0, self.used_bytes - self.ours_bytes)


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between ticks (monotonic seconds)."""

    last_shrink_at: float | None = None
    last_grow_at: float | None = None


Action = Literal["shrink", "grow", "hold"]


@dataclass(frozen=True)
class Decision:
    action: Action
    targets: dict[str, int] = field(default_factory=dict)  # engine key -> new cache bytes (changed only)
    memory_pressure: bool = False
    state: PolicyState = PolicyState()
    reason: str = ""


def _whole_experts(nbytes: float, cache: CacheState) -> int:
    """Round down to a whole number of experts, clamped to [floor, max]."""
    if cache.expert_bytes <= 0:
        return cache.capacity_bytes
    n = int(nbytes // cache.expert_bytes)
    n = max(cache.min_experts, min(cache.max_experts, n))
    return n * cache.expert_bytes


def _shrink_targets(caches: tuple[CacheState, ...], release: int) -> dict[str, int]:
    """Take ``release`` bytes from the caches in proportion to their size above the floor."""
    above = [max(0, c.capacity_bytes - c.floor_bytes) for c in caches]
    total_above = sum(above)
    if total_above == 0:
        return {}
    release = min(release, total_above)
    targets = {}
    for cache, a in zip(caches, above):
        share = -(-a * release // total_above)  # ceil, in integers: no float rounding loss
        new = _whole_experts(cache.capacity_bytes - share, cache)
        if new < cache.capacity_bytes:
            targets[cache.key] = new
    return targets


def _grow_targets(caches: tuple[CacheState, ...], room: int, step_fraction: float) -> dict[str, int]:
    """Share ``room`` bytes among caches below their maximum, each by at most one step."""
    growable = [c for c in caches if c.capacity_bytes < c.max_bytes]
    targets: dict[str, int] = {}
    for i, cache in enumerate(growable):
        share = room / (len(growable) - i)
        step = max(cache.expert_bytes, int(step_fraction * cache.max_bytes))
        new = _whole_experts(cache.capacity_bytes + min(share, step), cache)
        if new > cache.capacity_bytes:
            targets[cache.key] = new
            room -= new - cache.capacity_bytes
    return targets


def decide(cfg: PolicyConfig, obs: Observation, state: PolicyState) -> Decision:
    """Return what to do now. Pure: no clock, no I/O; ``obs.now`` is the time."""
    headroom = cfg.headroom(obs.total_bytes)
    free = obs.free_bytes
    floors = sum(c.floor_bytes for c in obs.caches)
    caches_total = sum(c.capacity_bytes for c in obs.caches)
    # Bytes all caches could occupy while leaving the headroom free.
    budget = caches_total + free - headroom
    pressure = bool(obs.caches) and budget < floors

    if free < headroom:
        targets = _shrink_targets(obs.caches, headroom - free)
        if targets:
            return Decision("shrink", targets, pressure, replace(state, last_shrink_at=obs.now),
                            f"free {free} < headroom {headroom}")
        return Decision("hold", {}, pressure, state, "pressed, every cache at its floor")

    if obs.psi_some_avg10 is not None and obs.psi_some_avg10 > cfg.psi_shrink_threshold:
        above = sum(max(0, c.capacity_bytes - c.floor_bytes) for c in obs.caches)
        targets = _shrink_targets(obs.caches, int(cfg.psi_shrink_fraction * above))
        if targets:
            return Decision("shrink", targets, pressure, replace(state, last_shrink_at=obs.now),
                            f"host PSI some avg10 {obs.psi_some_avg10:.1f}%")
        return Decision("hold", {}, pressure, replace(state, last_shrink_at=obs.now), "host PSI high")

    room = free - headroom - cfg.hysteresis_bytes
    if room <= 0:
        return Decision("hold", {}, pressure, state, "inside the hysteresis band")
    if state.last_shrink_at is not None and obs.now - state.last_shrink_at < cfg.cooldown_seconds:
        return Decision("hold", {}, pressure, state, "cooling down after a shrink")
    if state.last_grow_at is not None and obs.now - state.last_grow_at < cfg.grow_interval_seconds:
        return Decision("hold", {}, pressure, state, "waiting between grow steps")
    targets = _grow_targets(obs.caches, room, cfg.grow_step_fraction)
    if not targets:
        return Decision("hold", {}, pressure, state, "every cache at its maximum")
    return Decision("grow", targets, pressure, replace(state, last_grow_at=obs.now), f"room {room}")
