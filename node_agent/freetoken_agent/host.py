"""Host facts from /proc: memory (MemTotal, MemAvailable), PSI memory pressure, CPU identity.

Every reader is absent-safe: a kernel without PSI (or a container that hides it) gives
``None``, never an exception. Paths are parameters so tests can point them at fixture files.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class HostMemory:
    total_bytes: int
    available_bytes: int

    @property
    def used_bytes(self) -> int:
        return max(0, self.total_bytes - self.available_bytes)


@dataclass(frozen=True)
class Psi:
    """``/proc/pressure/memory``: share of wall time (percent) some / all tasks stalled on memory."""

    some_avg10: float
    some_avg60: float
    full_avg10: float
    full_avg60: float


def read_meminfo(path: str = "/proc/meminfo") -> HostMemory:
    """MemTotal and MemAvailable in bytes. Raises ``OSError`` when the file cannot be read."""
    fields: dict[str, int] = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
                fields[name] = int(parts[0]) * scale
    total = fields.get("MemTotal", 0)
    available = fields.get("MemAvailable", fields.get("MemFree", 0))
    return HostMemory(total_bytes=total, available_bytes=available)


def read_psi(path: str = "/proc/pressure/memory") -> Psi | None:
    """Parse PSI memory pressure; ``None`` when the kernel does not provide it."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    rows: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, *pairs = line.split()
        values = {}
        for pair in pairs:
            k, _, v = pair.partition("=")
            try:
                values[k] = float(v)
            except ValueError:
                continue
        rows[kind] = values
    if "some" not in rows:
        return None
    some, full = rows["some"], rows.get("full", {})
    return Psi(some_avg10=some.get("avg10", 0.0), some_avg60=some.get("avg60", 0.0),
               full_avg10=full.get("avg10", 0.0), full_avg60=full.get("avg60", 0.0))


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    """The CPU model name, or the platform's processor string when /proc/cpuinfo lacks it."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_cores() -> int:
    """CPUs this process may run on (the cgroup/affinity view, not the whole machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
