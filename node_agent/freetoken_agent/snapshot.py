"""A point-in-time view of the node, shared by the status reporter and the metrics collector.

The agent builds a ``NodeSnapshot`` (immutable) from its live state; ``to_status`` turns it
into ``FreeTokenNode.status`` as docs/contracts.md defines it, and the metrics collector reads
the same object at scrape time, so the cluster and Prometheus never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from .gpu import GpuReading
from .host import Psi


@dataclass(frozen=True)
class ReplicaSnapshot:
    key: str
    model: str
    state: str  # starting | ready | failed | stopped
    endpoint: str
    restarts: int
    message: str
    expert_cache_bytes: int | None
    expert_cache_floor_bytes: int | None
    expert_cache_max_bytes: int | None
    device: str
    fetched_bytes: int | None = None      # a source.url download in progress: bytes so far
    fetch_size_bytes: int | None = None   # ... and its size, when the server says


@dataclass(frozen=True)
class NodeSnapshot:
    node: str
    mode: str  # gpu | cpu
    address: str
    domain: str  # where the expert caches live: nvml | simulated | host
    gpus: tuple[GpuReading, ...]
    total_bytes: int  # of the policy's memory domain
    used_bytes: int
    ours_bytes: int
    headroom_bytes: int
    cpu_cores: int
    ram_total_bytes: int
    ram_available_bytes: int
    psi: Psi | None
    calibration: dict | None
    memory_pressure: bool
    replicas: tuple[ReplicaSnapshot, ...] = ()
    assignment_error: str | None = None
    pressure_since: str | None = None  # RFC3339 of the last MemoryPressure transition
    assignment_since: str | None = None  # RFC3339 of the last AssignmentsValid transition
    stored_sha256: tuple[str, ...] = ()  # source.url files in the model store, by sha256
    taken_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    @property
    def foreign_bytes(self) -> int:
        return max(0, self.used_bytes - self.ours_bytes)


def rfc3339(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(ctype: str, ok: bool, reason: str, message: str, since: str) -> dict:
    return {"type": ctype, "status": "True" if ok else "False", "reason": reason,
            "message": message, "lastTransitionTime": since}


def to_status(s: NodeSnapshot) -> dict:
    """``FreeTokenNode.status`` for this snapshot."""
    now = rfc3339(s.taken_at)
    cal = s.calibration or {}
    gpu = None
    if s.gpus:
        gpu = {"name": s.gpus[0].name, "count": len(s.gpus),
               "vramTotalBytes": sum(g.total_bytes for g in s.gpus),
               "vramUsedBytes": sum(g.used_bytes for g in s.gpus),
               "vramOursBytes": s.ours_bytes if s.domain != "host" else 0,
               "vramForeignBytes": s.foreign_bytes if s.domain != "host" else 0}
    pressure_since = s.pressure_since or now
    conditions = [_condition(
        "MemoryPressure", s.memory_pressure,
        "CacheAtFloor" if s.memory_pressure else "HeadroomAvailable",
        (f"expert caches at their floor and free memory below the {s.headroom_bytes} B headroom"
         if s.memory_pressure else "expert caches can absorb the node's memory use"),
        pressure_since)]
    conditions.append(_condition(
        "AssignmentsValid", s.assignment_error is None,
        "Invalid" if s.assignment_error else "Valid", s.assignment_error or "",
        s.assignment_since or now))
    return {
        "heartbeat": now,
        "mode": s.mode,
        "address": s.address,
        "gpu": gpu,
        "cpuCores": s.cpu_cores,
        "ramTotalBytes": s.ram_total_bytes,
        "ramAvailableBytes": s.ram_available_bytes,
        "pcieGbps": cal.get("pcie_gbps"),
        "cpuExpertGbps": cal.get("cpu_expert_gbps"),
        "fillFraction": cal.get("fill_fraction"),
        "memoryPressure": s.memory_pressure,
        "storedSha256": list(s.stored_sha256),
        "replicas": [{"key": r.key, "state": r.state, "endpoint": r.endpoint,
                      "expertCacheBytes": r.expert_cache_bytes or 0, "restarts": r.restarts,
                      "message": r.message} for r in s.replicas],
        "conditions": conditions,
    }
