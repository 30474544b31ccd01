"""The CUDA context made during the imports (``packed/early_cuda.py``): started by ``preload``
for a CUDA device only, harmless without a driver, and on a GPU the very context torch uses."""
from __future__ import annotations

import pytest
import torch
from procs import python_json

from freetoken_engine.packed import early_cuda, load_packed, preload


@pytest.fixture
def fresh(monkeypatch):
    """early_cuda as in a new process (it starts once per process)."""
    monkeypatch.setattr(early_cuda, "_thread", None)
    monkeypatch.setattr(early_cuda, "_status", {})
    return early_cuda


def test_device_strings_map_to_cuda_ordinals():
    assert [early_cuda.ordinal(d) for d in ("cuda", "cuda:0", "cuda:3", "cpu", None, "cuda:x")] == \
        [0, 0, 3, None, None, None]


def test_a_cpu_device_starts_nothing(fresh, tiny_packed):
    _, out = tiny_packed
    preload(out, device="cpu")
    assert fresh.status() == {} and fresh._thread is None
    assert load_packed(out).stats["preloaded"]


class _Driver:
    """libcuda's three calls, the first returning ``init_rc``."""

    def __init__(self, init_rc: int):
        self.init_rc, self.calls = init_rc, []

    def cuInit(self, flags):
        self.calls.append("cuInit")
        return self.init_rc

    def cuDeviceGet(self, dev, ordinal):
        self.calls.append(("cuDeviceGet", ordinal))
        return 0

    def cuDevicePrimaryCtxRetain(self, ctx, dev):
        self.calls.append("cuDevicePrimaryCtxRetain")
        return 0


def test_the_context_is_retained_for_the_asked_device_once(fresh, monkeypatch):
    driver = _Driver(0)
    monkeypatch.setattr(early_cuda.ctypes, "CDLL", lambda name: driver)
    assert fresh.start("cuda:2") is not None
    st = fresh.status()
    assert st["device"] == 2 and st["error"] is None and st["seconds"] >= 0
    assert driver.calls == ["cuInit", ("cuDeviceGet", 2), "cuDevicePrimaryCtxRetain"]
    assert fresh.start("cuda:2") is None and len(driver.calls) == 3          # once per process


def test_a_driver_error_is_reported_and_the_load_goes_on(fresh, monkeypatch, tiny_packed):
    _, out = tiny_packed
    driver = _Driver(100)                     # CUDA_ERROR_NO_DEVICE
    monkeypatch.setattr(early_cuda.ctypes, "CDLL", lambda name: driver)
    preload(out, device="cuda")
    assert fresh.status()["error"] == "cuInit returned CUDA error 100"
    assert driver.calls == ["cuInit"]
    assert load_packed(out).stats["preloaded"]


def test_without_a_driver_library_it_says_so(fresh, monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(early_cuda.ctypes, "CDLL", missing)
    fresh.start("cuda")
    assert "libcuda.so.1" in fresh.status()["error"]


PROBE = """
import ctypes, json
from freetoken_engine.packed import early_cuda
early_cuda.start("cuda")
status = early_cuda.status()
import torch
x = torch.ones(4, device="cuda") * 2
current = ctypes.c_void_p()
ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(current))
print(json.dumps({"status": status, "current": current.value, "sum": float(x.sum())}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_uses_the_context_made_before_it_was_imported():
    got = python_json(PROBE, timeout=120)
    assert got["status"]["error"] is None and got["status"]["context"]
    assert got["current"] == got["status"]["context"] and got["sum"] == 8.0
