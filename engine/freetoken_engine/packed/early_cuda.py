"""The CUDA context made while torch is still being imported (a restart's fixed cost, hidden).

A restart on a GPU pays, before the first kernel, for the driver's initialisation and the
device's primary context; torch creates both lazily at the engine's first CUDA call, after its
own import. ``start("cuda:N")`` (called by ``preload``, and by ``freetoken generate`` / ``serve``
for any model folder under the same rule, ``FREETOKEN_PRELOAD``; before torch is imported) does
it on a background thread through the driver library: ``cuInit``, then ``cuDevicePrimaryCtxRetain``.
The CUDA runtime, and so torch, uses that same primary context (one per device and process), so
torch finds it made. The retained reference is kept for the process's life, as torch keeps its
own. Nothing here imports torch; ctypes releases the GIL during each driver call, so the imports
run beside it.

Any failure (no driver, no such device) only means torch makes the context later as usual;
``status()`` says what happened. The device ordinal is the driver's, after
``CUDA_VISIBLE_DEVICES``, as torch's is.
"""
from __future__ import annotations

import ctypes
import threading
import time

_lock = threading.Lock()
_thread: threading.Thread | None = None
_status: dict = {}


def ordinal(device: str | None) -> int | None:
    """The CUDA device ordinal of an engine device string ("cuda" -> 0, "cuda:2" -> 2), None for
    anything that is not a CUDA device."""
    if not device or not device.startswith("cuda"):
        return None
    _, _, n = device.partition(":")
    return int(n) if n.isdigit() else (0 if not n else None)


def start(device: str | None) -> threading.Thread | None:
    """Create device ``device``'s primary context in the background; None (and nothing done) for
    a device that is not CUDA, or when a context was already started in this process."""
    global _thread
    n = ordinal(device)
    if n is None:
        return None
    with _lock:
        if _thread is not None:
            return None
        _status.update(device=n, seconds=None, error=None)
        _thread = threading.Thread(target=_open, args=(n,), name="ft-cuda-context", daemon=True)
        _thread.start()
        return _thread


def started_device() -> str | None:
    """"cuda:N" when ``start`` was called for device N in this process, else None."""
    return f"cuda:{_status['device']}" if "device" in _status else None


def status(wait: bool = True) -> dict:
    """What ``start`` did: {"device": N, "seconds": ..., "error": None or why}; {} when it was
    never started. ``wait``: join the thread first."""
    t = _thread
    if t is not None and wait:
        t.join()
    return dict(_status)


def _open(device: int) -> None:
    t0 = time.perf_counter()
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        _status["error"] = "no CUDA driver library (libcuda.so.1)"
        return
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    for name, call in (("cuInit", lambda: lib.cuInit(0)),
                       ("cuDeviceGet", lambda: lib.cuDeviceGet(ctypes.byref(dev), device)),
                       ("cuDevicePrimaryCtxRetain",
                        lambda: lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))):
        rc = call()
        if rc != 0:
            _status["error"] = f"{name} returned CUDA error {rc}"
            return
    _status.update(seconds=time.perf_counter() - t0, context=ctx.value)
