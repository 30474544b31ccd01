"""Memory sources: /proc readers (absent-safe), the simulated GPU, NVML on a machine without one."""

import json

import pytest

from types import SimpleNamespace

from freetoken_agent.gpu import GpuError, NvmlSource, SimulatedGpu, open_gpu_source
from freetoken_agent.host import read_meminfo, read_psi


def test_meminfo_parses_kib_lines(tmp_path):
    p = tmp_path / "meminfo"
    p.write_text("MemTotal:       16000000 kB\nMemFree:  1000 kB\nMemAvailable:    4000000 kB\n"
                 "HugePages_Total:       0\n")
    m = read_meminfo(str(p))
    assert (m.total_bytes, m.available_bytes) == (16000000 * 1024, 4000000 * 1024)
    assert m.used_bytes == 12000000 * 1024


def test_real_meminfo_is_plausible():
    m = read_meminfo()
    assert 0 < m.available_bytes <= m.total_bytes


def test_psi_parses_and_is_absent_safe(tmp_path):
    p = tmp_path / "memory"
    p.write_text("some avg10=12.50 avg60=3.00 avg300=1.00 total=123\n"
                 "full avg10=4.25 avg60=1.00 avg300=0.00 total=45\n")
    psi = read_psi(str(p))
    assert (psi.some_avg10, psi.full_avg10, psi.some_avg60) == (12.5, 4.25, 3.0)
    assert read_psi(str(tmp_path / "missing")) is None  # kernels without CONFIG_PSI
    (tmp_path / "garbage").write_text("nothing useful\n")
    assert read_psi(str(tmp_path / "garbage")) is None


def test_simulated_gpu_file_counts_foreign_plus_ours(tmp_path):
    f = tmp_path / "gpu.json"
    f.write_text(json.dumps({"name": "Sim 8G", "total_bytes": 8_000, "foreign_bytes": 1_000}))
    ours = {"v": 2_000}
    gpu = SimulatedGpu(lambda: ours["v"], path=str(f))
    [r] = gpu.read()
    assert (r.name, r.total_bytes, r.used_bytes) == ("Sim 8G", 8_000, 3_000)
    f.write_text(json.dumps({"name": "Sim 8G", "total_bytes": 8_000, "foreign_bytes": 7_500}))
    import os
    os.utime(f, ns=(10**18, 10**18))  # a distinct mtime even on coarse-grained filesystems
    [r] = gpu.read()
    assert r.used_bytes == 8_000  # a device never reports more than it has


def test_simulated_gpu_in_process_and_bad_file(tmp_path):
    gpu = SimulatedGpu(lambda: 100, total_bytes=1_000)
    gpu.set_foreign(300)
    assert gpu.read()[0].used_bytes == 400
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(GpuError):
        SimulatedGpu(lambda: 0, path=str(bad))


def _has_nvidia_gpu() -> bool:
    try:
        NvmlSource.open().close()
        return True
    except GpuError:
        return False


@pytest.mark.skipif(_has_nvidia_gpu(), reason="this machine has a GPU")
def test_without_gpu_nvml_reports_cpu_mode():
    with pytest.raises(GpuError):
        NvmlSource.open()
    assert open_gpu_source(lambda: 0) is None  # the agent then runs in CPU mode


class _Nvml:
    """The few pynvml calls the source makes, answering like a driver that reports reserved
    memory apart from ``used`` (so ``total - used`` is not what can be allocated)."""

    class NVMLError(Exception):
        pass

    def __init__(self, total: int, used: int, reserved: int) -> None:
        self.mem = SimpleNamespace(total=total, used=used, reserved=reserved, free=total - used - reserved)

    def nvmlDeviceGetName(self, h):
        return b"H200 (fake)"

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        return self.mem

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return 16


def test_nvml_used_is_everything_not_free():
    # H200 at 580.x: 1.74 GB free, 0.6 GB reserved. Reading total - used said 2.34 GB free, above
    # a 2 GiB headroom, and the agent never shrank (the first pressure run on the H200).
    nv = _Nvml(total=150_754_820_096, used=148_410_000_000, reserved=600_000_000)
    [r] = NvmlSource(nv, [object()]).read()
    assert r.total_bytes - r.used_bytes == nv.mem.free == 1_744_820_096
    assert (r.name, r.pcie_generation, r.pcie_width) == ("H200 (fake)", 5, 16)


@pytest.mark.gpu
def test_nvml_free_is_what_cuda_can_allocate():
    torch = pytest.importorskip("torch")
    src = NvmlSource.open()
    try:
        free_cuda, total_cuda = torch.cuda.mem_get_info(0)
        [r, *_] = src.read()
    finally:
        src.close()
    # CUDA's total leaves out the driver's reserved memory (0.64 GB on the H200); NVML's does not.
    assert 0 <= r.total_bytes - total_cuda < 2 << 30
    # Both read the same device a moment apart; this process's own context is already counted.
    assert abs((r.total_bytes - r.used_bytes) - free_cuda) < 64 << 20


@pytest.mark.gpu
def test_nvml_reads_a_real_gpu():
    src = NvmlSource.open()
    try:
        readings = src.read()
    finally:
        src.close()
    assert readings and all(0 <= r.used_bytes < r.total_bytes for r in readings)  # an idle card reads 0
    assert readings[0].name
