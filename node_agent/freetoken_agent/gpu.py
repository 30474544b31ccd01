"""Where the agent reads GPU memory: NVML on a real GPU, a simulated device in tests.

Interface (``GpuSource``): ``kind`` ("nvml" | "simulated"), ``read() -> list[GpuReading]``
(one per device, bytes, device-level totals; ``used`` is everything not free, reserved
memory included), ``close()``.
``read`` raises ``GpuError`` when the driver stops answering; the agent then keeps its last
decision and retries.

The simulated device is driven through a small JSON file (so a test can change it while an
agent subprocess runs) or in-process (``SimulatedGpu.set_foreign``)::

    {"name": "Simulated GPU", "total_bytes": 8000000000, "foreign_bytes": 0}

Its ``used`` is ``foreign_bytes`` plus what the agent's own engines hold, read through the
``ours`` callable, exactly what a real device would report.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Callable, Protocol


class GpuError(RuntimeError):
    """The GPU memory source could not be read."""


@dataclass(frozen=True)
class GpuReading:
    index: int
    name: str
    total_bytes: int
    used_bytes: int
    pcie_generation: int | None = None
    pcie_width: int | None = None


def used_of(mem) -> int:
    """Device memory nobody can allocate any more: ``total - free``.

    ``free`` is the one field every NVML memory struct agrees on and what a ``cudaMalloc``
    can still get. ``used`` is not: in ``nvmlMemory_v2_t`` the driver's reserved memory
    (about half a GB on an H200) is reported apart from ``used`` (newer drivers), so
    ``total - used`` overstates what the node's owner can still take by that much, and a
    shrink that the headroom calls for would never come.
    """
    return max(0, int(mem.total) - int(mem.free))


class GpuSource(Protocol):
    kind: str

    def read(self) -> list[GpuReading]: ...

    def close(self) -> None: ...


class NvmlSource:
    """Real GPUs through ``pynvml`` (package ``nvidia-ml-py``). Construct with :meth:`open`."""

    kind = "nvml"

    def __init__(self, pynvml_module, handles: list) -> None:
        self._nvml = pynvml_module
        self._handles = handles
        self._names = [self._str(pynvml_module.nvmlDeviceGetName(h)) for h in handles]

    @staticmethod
    def _str(value) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    @classmethod
    def open(cls) -> "NvmlSource":
        """Initialise NVML; raises ``GpuError`` when there is no driver or no device."""
        try:
            import pynvml
        except ImportError as exc:  # nvidia-ml-py is a dependency, but be explicit
            raise GpuError(f"pynvml not importable: {exc}") from exc
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except pynvml.NVMLError as exc:
            raise GpuError(f"NVML unavailable: {exc}") from exc
        if not handles:
            pynvml.nvmlShutdown()
            raise GpuError("NVML found no GPU")
        return cls(pynvml, handles)

    def read(self) -> list[GpuReading]:
        nv = self._nvml
        out = []
        try:
            for i, h in enumerate(self._handles):
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                try:
                    gen = int(nv.nvmlDeviceGetCurrPcieLinkGeneration(h))
                    width = int(nv.nvmlDeviceGetCurrPcieLinkWidth(h))
                except nv.NVMLError:
                    gen = width = None
                out.append(GpuReading(i, self._names[i], int(mem.total), used_of(mem), gen, width))
        except nv.NVMLError as exc:
            raise GpuError(f"NVML read failed: {exc}") from exc
        return out

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


class SimulatedGpu:
    """One simulated device. File-driven when ``path`` is given, else set in-process."""

    kind = "simulated"

    def __init__(self, ours: Callable[[], int], path: str | None = None,
                 name: str = "Simulated GPU", total_bytes: int = 8 << 30) -> None:
        self._ours = ours
        self._path = path
        self._lock = threading.Lock()
        self._name, self._total, self._foreign = name, total_bytes, 0
        self._mtime: float | None = None
        if path is not None:
            self._reload()

    def set_foreign(self, foreign_bytes: int, total_bytes: int | None = None) -> None:
        with self._lock:
            self._foreign = int(foreign_bytes)
            if total_bytes is not None:
                self._total = int(total_bytes)

    def _reload(self) -> None:
        try:
            mtime = os.stat(self._path).st_mtime_ns
            if mtime == self._mtime:
                return
            with open(self._path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise GpuError(f"simulated GPU file {self._path}: {exc}") from exc
        with self._lock:
            self._name = str(data.get("name", self._name))
            self._total = int(data.get("total_bytes", self._total))
            self._foreign = int(data.get("foreign_bytes", 0))
            self._mtime = mtime

    def read(self) -> list[GpuReading]:
        if self._path is not None:
            self._reload()
        with self._lock:
            name, total, foreign = self._name, self._total, self._foreign
        used = min(total, foreign + max(0, int(self._ours())))
        return [GpuReading(0, name, total, used)]

    def close(self) -> None:
        pass


def open_gpu_source(ours: Callable[[], int], simulated_file: str | None = None) -> GpuSource | None:
    """The simulated device when a file is named, else NVML, else ``None`` (CPU mode)."""
    if simulated_file:
        return SimulatedGpu(ours, path=simulated_file)
    try:
        return NvmlSource.open()
    except GpuError:
        return None
