"""Bandwidth calibration behind q*: B_pcie, B_cpu, both alone and while running at once.

q* balances a step's two sides: q filled experts cost q*S/B_pcie, the m - q computed in
place cost (m - q)*S/B_cpu, so the fill fraction q*/m = B_pcie / (B_pcie + B_cpu), taken from
the *concurrent* pair (they share host memory). B_cpu is the rate of decode-sized calls (one
expert per call), the CPU's real share of a layer call; B_pcie the rate of decode's own fills (one
launch of the fill gather a fill; DMA copies where the gather cannot run: ``pcie_path``). Without a GPU there is no PCIe side: the cache
lives in host memory and ``fill_fraction`` is 1.0. Results are cached per host configuration.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from . import env
from .cachefile import read_json, write_json
from .kernels.split import check_speed

log = logging.getLogger(__name__)

HIDDEN, INTER = 2048, 768      # Qwen3-30B-A3B expert rows: 9.4 MB in bf16
# A measurement is taken beside another process (cpu_contended) when this many of its CPU kernel
# calls waited for a worker held off its CPU. One is a hiccup (a worker descheduled once costs a
# few ms of a second's thousands of calls); a process that keeps a CPU busy stalls calls again
# each time the worker comes back from its time-out (20, 40, 80 ms ...): five or six in a second.
CONTENDED_STALLS = 3


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
    and a split balanced on the larger rate gives the CPU more than it finishes in time.

    With the compiled kernel the calls run back to back from C (``cpu_experts.calls_seconds``),
    as the engine's C++ CPU branch runs them: no Python call around each (15-20 us on the H200
    host against ~100 us for the call) and the GIL released, so a thread queueing the PCIe
    copies is not held up either. Without it, a Python loop over the reference."""

    def __init__(self, per_call: int = 1):
        from .kernels import cpu_expert_forward
        backend, self.fn = cpu_expert_forward()
        self.per = 3 * HIDDEN * INTER * 2
        n = max(4 * per_call, 3 * _llc_bytes() // self.per + 1)
        self.w13 = torch.randn(n, 2 * INTER, HIDDEN).to(torch.bfloat16)
        self.w2 = torch.randn(n, HIDDEN, INTER).to(torch.bfloat16)
        self.x = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
        self.tok = torch.zeros(per_call, dtype=torch.int64)
        self.calls = torch.arange(n // per_call * per_call).view(-1, per_call)
        self.from_c = backend == "compiled"
        self._batch(self.calls)                      # first use: build, pool start, page faults

    def _batch(self, exps: torch.Tensor) -> float:
        """Seconds for one call per row of exps."""
        if self.from_c:
            from .kernels import cpu_experts
            return cpu_experts.calls_seconds(self.x, self.w13, self.w2, self.tok, exps)
        t0 = time.perf_counter()
        for e in exps:
            self.fn(self.x, self.w13, self.w2, self.tok, e)
        return time.perf_counter() - t0

    def gbps(self, seconds: float, until=None) -> float:
        """GB/s of expert weights read, cycling through the rows for ``seconds`` or, given
        ``until``, until it returns True (checked every 16 calls)."""
        done, busy, t0, i = 0, 0.0, time.perf_counter(), 0
        while True:
            batch = self.calls[i:i + 16]
            busy += self._batch(batch)
            done, i = done + len(batch), (i + 16) % len(self.calls)
            if (until() if until else time.perf_counter() - t0 >= seconds):
                return done * self.tok.numel() * self.per / busy / 1e9


class _PcieCopies:
    """Pinned host -> device copies of 16 experts' bytes (151 MB) each, queued on the current
    stream and timed by events; the host thread only queues them, so it can time the CPU
    kernel meanwhile (a second Python thread would contend with it for the GIL)."""

    path = "dma"
    max_queued = 1 << 30    # copies queued at once (a launch queue that fills up blocks the host)

    def __init__(self, device: torch.device):
        self.per = 16 * 3 * HIDDEN * INTER * 2
        self.src = torch.empty(self.per, dtype=torch.uint8).pin_memory()
        self.dst = torch.empty(self.per, dtype=torch.uint8, device=device)
        self.device = device
        self._copy()
        torch.cuda.synchronize(device)

    def _copy(self) -> None:
        self.dst.copy_(self.src, non_blocking=True)

    def queue(self, seconds: float, gbps_guess: float = 50.0):
        """Queue about ``seconds`` of copies; -> (copies, start event, end event)."""
        n = max(4, min(self.max_queued, int(seconds * gbps_guess * 1e9 / self.per)))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self.device):
            start.record()
            for _ in range(n):
                self._copy()
            end.record()
        return n, start, end

    def rate(self, n: int, start, end) -> float:
        """GB/s of ``n`` queued copies timed by (start, end), once they are done."""
        end.synchronize()
        return n * self.per / (start.elapsed_time(end) / 1e3) / 1e9

    def gbps(self, seconds: float) -> float:
        return self.rate(*self.queue(seconds))


class _GatherFills(_PcieCopies):
    """Decode's own fill path: one launch of the fill gather (``kernels/triton/gather.py``: the GPU
    reads pinned host memory) a fill, one expert's rows (9.4 MB) each, a different one of 16 each
    time (151 MB: beyond the GPU's L2). A decode step's fills cross PCIe this way, not by DMA, and
    on some hosts the gather draws much less than the DMA (an H100 host: 30-34 GB/s against 50-53,
    bench/results/gpu_offload_h100_stop68.json), so a B_pcie timed by DMA made q* fill too much."""

    path = "gather"
    # 512 launches (4.8 GB, 0.1-0.2 s): all queued before the CPU's side starts, as the MoE bench's
    # 960 (a host that blocked on a full launch queue would time the gather alone, not beside it)
    max_queued = 512

    def __init__(self, device: torch.device):
        from .kernels.triton.gather import gather_fill_rows
        self.fill = gather_fill_rows
        self.per, self.device, self.turn = 3 * HIDDEN * INTER * 2, device, 0
        self.src13 = torch.empty((1, 16, 2 * INTER, HIDDEN), dtype=torch.bfloat16).pin_memory()
        self.src2 = torch.empty((1, 16, HIDDEN, INTER), dtype=torch.bfloat16).pin_memory()
        self.dst13 = torch.empty((1, 2 * INTER, HIDDEN), dtype=torch.bfloat16, device=device)
        self.dst2 = torch.empty((1, HIDDEN, INTER), dtype=torch.bfloat16, device=device)
        self.experts = [torch.tensor([e], device=device) for e in range(16)]
        self.slot = torch.zeros(1, dtype=torch.int64, device=device)
        self._copy()                          # compiles the kernel
        torch.cuda.synchronize(device)

    def _copy(self) -> None:
        self.turn += 1
        self.fill(self.src13, self.src2, self.dst13, self.dst2, 0, self.experts[self.turn % 16], self.slot)


def _fills(device: torch.device) -> _PcieCopies:
    """How B_pcie is timed: decode's fill gather where Triton runs, else DMA copies (with a warning
    when the gather cannot start: the split then assumes the DMA's rate)."""
    try:
        return _GatherFills(device)
    except (ImportError, RuntimeError) as exc:
        log.warning("calibration: the fill gather did not run (%s); timing B_pcie with DMA copies", exc)
        return _PcieCopies(device)


def fill_fraction(pcie: float | None, cpu: float) -> float:
    if not pcie:
        return 1.0
    return pcie / (pcie + cpu)


def _stalled_calls() -> int | None:
    from .kernels import cpu_experts
    return cpu_experts.pool_stats().get("stalled_calls")


def measure(device: str = "cpu", seconds: float = 1.0) -> dict:
    """The bandwidths behind q* on this host; ``cpu_stalled_calls``: the CPU kernel's calls
    during the measurement that waited for a worker another process kept off its CPU, and
    ``cpu_contended``: at least CONTENDED_STALLS of them, so the figures hold only while that
    process runs (load_or_measure keeps them out of the cache, and so does the agent)."""
    dev = torch.device(device)
    cpu = _CpuExperts()
    stalled_before = _stalled_calls()
    cpu_alone = cpu.gbps(seconds)
    pcie_alone = conc_pcie = None
    conc_cpu = cpu_alone
    if dev.type == "cuda":
        pcie = _fills(dev)
        pcie_alone = pcie.gbps(seconds)
        n, start, end = pcie.queue(seconds, pcie_alone)
        conc_cpu = cpu.gbps(seconds, until=end.query)        # the CPU works while the copies run
        conc_pcie = pcie.rate(n, start, end)
    stalled_after = _stalled_calls()
    stalled = stalled_after - stalled_before if stalled_before is not None and stalled_after is not None else 0
    return {"pcie_gbps": pcie_alone, "pcie_path": pcie.path if dev.type == "cuda" else None,
            "cpu_expert_gbps": cpu_alone,
            "concurrent": {"pcie_gbps": conc_pcie, "cpu_expert_gbps": conc_cpu},
            "fill_fraction": fill_fraction(conc_pcie, conc_cpu), "device": dev.type,
            "host": socket.gethostname(), "measured_at": datetime.now(timezone.utc).isoformat(),
            "cpu_stalled_calls": max(0, stalled), "cpu_contended": stalled >= CONTENDED_STALLS}


def _cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else the machine type. Not platform.processor(),
    which runs ``uname -p``: an exec whose binary a restart reads from a disk busy with the
    bank's read (0.1 s on the H200 host, device run 78)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.machine()


def _cache_path(device: torch.device) -> Path:
    from .kernels.cpu_experts import default_threads
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    # v2: B_cpu from C-driven calls, the PCIe copies queued (not driven by a second thread).
    # v3: also the CPU expert kernel's threads and backend choice, which set B_cpu (before, a
    # user who gave the kernel fewer CPUs kept the q* measured with all of them).
    kernel = f"{env.cpu_expert_backend() or ''}|{os.environ.get(env.FREETOKEN_CPU_KERNEL, '')}"
    # v4: the CPU's model name (v3 had platform.processor(), "x86_64" on most Linux machines).
    # v5: B_pcie timed through decode's fill gather, not DMA copies (``_GatherFills``).
    key = (f"v5|{_cpu_name()}|{torch.get_num_threads()}|{default_threads()}|{kernel}|{gpu}|"
           f"{torch.__version__}")
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return env.cache_dir() / "calibration" / f"{socket.gethostname()}-{device.type}-{digest}.json"


def _model_rate_path(device: torch.device, shape: str) -> Path:
    host = _cache_path(device)
    return host.with_name(f"{host.stem}-expert-rate-{shape}.json")


def cached_model_rate(device: torch.device | str, shape: str) -> float | None:
    """The CPU kernel's rate (GB/s, one-expert calls from C) on experts of ``shape`` (e.g.
    ``2048x768-bfloat16``) measured on this host configuration before (``save_model_rate``), or
    None: the q* follower's reference (executor/cpu_contention.py), so a restart need not
    measure it after the bank's read, which it overlaps with the decode graphs' capture."""
    rate = (read_json(_model_rate_path(torch.device(device), shape)) or {}).get("cpu_expert_gbps")
    return float(rate) if isinstance(rate, (int, float)) and rate > 0 else None


def cached_call_speed(device: torch.device | str, shape: str) -> tuple[float, ...] | None:
    """The CPU's call-size curve (``kernels/split.py``) saved with the model's rate, or None (none
    saved, or one out of shape: measure again)."""
    try:
        return check_speed((read_json(_model_rate_path(torch.device(device), shape)) or {}).get("cpu_call_speed"))
    except (TypeError, ValueError):
        return None


def save_model_rate(device: torch.device | str, shape: str, gbps: float,
                    speed: tuple[float, ...] | None = None) -> None:
    write_json(_model_rate_path(torch.device(device), shape),
               {"cpu_expert_gbps": gbps, "cpu_call_speed": None if speed is None else list(speed), "shape": shape,
                "measured_at": datetime.now(timezone.utc).isoformat()})


def calibrated(device: torch.device | str) -> bool:
    """Whether ``load_or_measure`` has a cached calibration for this host configuration (so it
    will measure nothing)."""
    return read_json(_cache_path(torch.device(device))) is not None


def load_or_measure(device: torch.device | str, refresh: bool = False) -> dict:
    """The cached calibration for this host configuration, measured (and cached) if absent. A
    measurement taken while another process held the kernel's CPUs (``cpu_contended``) is
    returned but not cached: it describes the host only while that process runs, and the next
    start measures again."""
    dev = torch.device(device)
    path = _cache_path(dev)
    cached = None if refresh else read_json(path)
    if cached is not None:
        return cached
    result = measure(dev.type if dev.type == "cpu" else str(dev))
    if result.get("cpu_contended"):
        log.warning("calibration: %d CPU kernel calls waited for a worker another process kept off its CPU; "
                    "using B_cpu %.1f GB/s for now, not caching it", result["cpu_stalled_calls"],
                    result["cpu_expert_gbps"])
        return result
    write_json(path, result)
    return result
