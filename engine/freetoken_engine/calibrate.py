"""Bandwidth calibration behind q*: B_pcie, B_cpu, both alone and while running at once.

q* balances a step's two sides: q filled experts cost q*S/B_pcie, the m - q computed in
place cost (m - q)*S/B_cpu, so the fill fraction q*/m = B_pcie / (B_pcie + B_cpu), taken from
the *concurrent* pair (they share host memory). B_cpu is the rate of decode-sized calls (one
expert per call), the CPU's real share of a layer call. Without a GPU there is no PCIe side: the cache
lives in host memory and ``fill_fraction`` is 1.0. Results are cached per host configuration.
"""
from __future__ import annotations

import hashlib
import json
import platform
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from . import env

HIDDEN, INTER = 2048, 768      # Qwen3-30B-A3B expert rows: 9.4 MB in bf16


def _llc_bytes() -> int:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text[:-1]) * (1024 if text.endswith("K") else 1024 * 1024)
    except (OSError, ValueError):
        return 32 * 1024 * 1024


class _CpuExperts:
    """The engine's CPU expert kernel on expert rows well beyond the last-level cache, built (and
    warmed up: first-use build, one pass) once, then timed alone and beside the PCIe copies.

    Decode-sized calls: one token on ``per_call`` experts per call. q* leaves the CPU one to a few
    experts per MoE layer call, and a call's fixed costs weigh on so few: on the H200 host one
    expert per call ran at 45-53 GB/s where calls of eight ran at 68-74 (bench/gpu_offload.py),
    and a split balanced on the larger rate gives the CPU more than it finishes in time."""

    def __init__(self, per_call: int = 1):
        from .kernels import cpu_expert_forward
        _, self.fn = cpu_expert_forward()
        self.per = 3 * HIDDEN * INTER * 2
        n = max(4 * per_call, 3 * _llc_bytes() // self.per + 1)
        self.w13 = torch.randn(n, 2 * INTER, HIDDEN).to(torch.bfloat16)
        self.w2 = torch.randn(n, HIDDEN, INTER).to(torch.bfloat16)
        self.x = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
        self.tok = torch.zeros(per_call, dtype=torch.int64)
        self.calls = [torch.arange(i, i + per_call) for i in range(0, n - per_call + 1, per_call)]
        for exp in self.calls:
            self._call(exp)

    def _call(self, exp: torch.Tensor) -> None:
        self.fn(self.x, self.w13, self.w2, self.tok, exp)

    def gbps(self, seconds: float) -> float:
        """GB/s of expert weights read, cycling through the rows for ``seconds``."""
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            self._call(self.calls[done % len(self.calls)])
            done += 1
        return done * self.tok.numel() * self.per / (time.perf_counter() - t0) / 1e9


def _pcie_gbps(device: torch.device, stop: threading.Event | None, seconds: float) -> float:
    per = 3 * HIDDEN * INTER * 2
    src = torch.empty(16, per, dtype=torch.uint8).pin_memory()
    dst = torch.empty(16, per, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and not (stop and stop.is_set()):
        for i in range(16):
            dst[i].copy_(src[i], non_blocking=True)
        torch.cuda.synchronize(device)
        done += 16
    return done * per / (time.perf_counter() - t0) / 1e9


def fill_fraction(pcie: float | None, cpu: float) -> float:
    if not pcie:
        return 1.0
    return pcie / (pcie + cpu)


def measure(device: str = "cpu", seconds: float = 1.0) -> dict:
    dev = torch.device(device)
    cpu = _CpuExperts()
    cpu_alone = cpu.gbps(seconds)
    pcie_alone = conc_pcie = None
    conc_cpu = cpu_alone
    if dev.type == "cuda":
        pcie_alone = _pcie_gbps(dev, None, seconds)
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("pcie", _pcie_gbps(dev, None, seconds)))
        t.start()
        conc_cpu = cpu.gbps(seconds)
        t.join()
        conc_pcie = out["pcie"]
    return {"pcie_gbps": pcie_alone, "cpu_expert_gbps": cpu_alone,
            "concurrent": {"pcie_gbps": conc_pcie, "cpu_expert_gbps": conc_cpu},
            "fill_fraction": fill_fraction(conc_pcie, conc_cpu), "device": dev.type,
            "host": socket.gethostname(), "measured_at": datetime.now(timezone.utc).isoformat()}


def _cache_path(device: torch.device) -> Path:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    key = f"{platform.processor()}|{torch.get_num_threads()}|{gpu}|{torch.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return env.cache_dir() / "calibration" / f"{socket.gethostname()}-{device.type}-{digest}.json"


def load_or_measure(device: torch.device | str, refresh: bool = False) -> dict:
    """The cached calibration for this host configuration, measured (and cached) if absent."""
    dev = torch.device(device)
    path = _cache_path(dev)
    if path.is_file() and not refresh:
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            pass
    result = measure(dev.type if dev.type == "cpu" else str(dev))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return result
