"""Bandwidth calibration (B_pcie, B_cpu, the concurrent pair, q*) and its per-node cache.

The measurement is the engine's own ``freetoken calibrate --json`` run as a subprocess (the
agent never imports torch). Its last stdout line is one JSON object (docs/contracts.md).

Results are cached in ``<state_dir>/calibration-<fingerprint>.json``. The fingerprint hashes
what the figures depend on: node name, CPU model and count, total RAM, GPU names, the
device measured; a change of any of them (a new GPU, a RAM upgrade) makes a fresh
measurement. ``load_or_measure`` returns a cached result younger than ``max_age`` seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from dataclasses import dataclass

from .host import cpu_cores, cpu_model, read_meminfo

REQUIRED = ("pcie_gbps", "cpu_expert_gbps", "concurrent", "fill_fraction")


class CalibrationError(RuntimeError):
    """``freetoken calibrate`` failed or printed something that is not the contract's object."""


@dataclass(frozen=True)
class HostConfig:
    """What calibration figures depend on; its fingerprint names the cache file."""

    node: str
    cpu_model: str
    cpu_count: int
    ram_bytes: int
    gpus: tuple[str, ...]
    device: str  # "cuda" | "cpu"

    @classmethod
    def detect(cls, node: str, gpus: tuple[str, ...]) -> "HostConfig":
        try:
            ram = read_meminfo().total_bytes
        except OSError:
            ram = 0
        return cls(node=node, cpu_model=cpu_model(), cpu_count=cpu_cores(), ram_bytes=ram,
                   gpus=gpus, device="cuda" if gpus else "cpu")

    def fingerprint(self) -> str:
        text = json.dumps([self.node, self.cpu_model, self.cpu_count, self.ram_bytes // (1 << 30),
                           list(self.gpus), self.device])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def parse_calibration(stdout: str) -> dict:
    """The JSON object on the last non-empty stdout line; raises ``CalibrationError``."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise CalibrationError("freetoken calibrate printed nothing")
    try:
        obj = json.loads(lines[-1])
    except ValueError as exc:
        raise CalibrationError(f"last line is not JSON: {lines[-1][:200]!r}") from exc
    if not isinstance(obj, dict) or any(k not in obj for k in REQUIRED):
        raise CalibrationError(f"calibration object lacks one of {REQUIRED}: {obj!r}")
    ff = obj["fill_fraction"]
    if not isinstance(ff, (int, float)) or not 0.0 <= ff <= 1.0:
        raise CalibrationError(f"fill_fraction must be in [0, 1], got {ff!r}")
    return obj


async def measure(engine_command: tuple[str, ...], device: str, refresh: bool = False,
                  timeout: float = 600.0) -> dict:
    """Run ``freetoken calibrate --device DEVICE --json`` and return its object. ``refresh``
    adds ``--refresh`` so the engine does not answer from its own cache either."""
    proc = await asyncio.create_subprocess_exec(
        *engine_command, "calibrate", "--device", device, "--json", *(["--refresh"] if refresh else []),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise CalibrationError(f"freetoken calibrate took longer than {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
        raise CalibrationError(f"freetoken calibrate exited {proc.returncode}: {tail[0]}")
    return parse_calibration(out.decode(errors="replace"))


class CalibrationCache:
    """Calibration results on disk, one file per host configuration."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir

    def path(self, host: HostConfig) -> str:
        return os.path.join(self.state_dir, f"calibration-{host.fingerprint()}.json")

    def load(self, host: HostConfig, max_age: float | None = None) -> dict | None:
        """The cached result, or ``None`` when absent, unreadable or older than ``max_age``."""
        try:
            with open(self.path(host), encoding="utf-8") as f:
                entry = json.load(f)
            result, saved_at = entry["result"], float(entry["saved_at"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if max_age is not None and time.time() - saved_at > max_age:
            return None
        return result

    def save(self, host: HostConfig, result: dict) -> bool:
        """Caches ``result``, unless the engine measured it while another process held the CPU
        kernel's CPUs (``cpu_contended``): that figure holds only while the process runs, so it
        is used but not kept, and the next start measures again. Returns whether it saved."""
        if result.get("cpu_contended"):
            return False
        os.makedirs(self.state_dir, exist_ok=True)
        tmp = self.path(host) + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"host": host.__dict__, "saved_at": time.time(), "result": result}, f)
        os.replace(tmp, self.path(host))  # atomic: a reader never sees half a file
        return True

    async def load_or_measure(self, host: HostConfig, engine_command: tuple[str, ...],
                              refresh: bool = False, max_age: float | None = None) -> tuple[dict, bool]:
        """(result, measured_now). Measures when refreshing or when nothing fresh is cached."""
        if not refresh:
            cached = self.load(host, max_age)
            if cached is not None:
                return cached, False
        result = await measure(engine_command, host.device, refresh=refresh)
        self.save(host, result)
        return result, True
