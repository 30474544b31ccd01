"""torch's first calls on a CUDA engine, made on a background thread while the engine's own
modules are still imported.

The first time a process runs a torch op it pays for more than the op: torch's CUDA state
(``torch.cuda.init``), the pages of torch's CPU and CUDA libraries and of cuBLAS that hold the
code, read from disk where the page cache does not have them. On a restart that disk is busy
with the expert bank's read, and a page read waits behind its queue: a stack sample of device run
77's restarts (``bench/restart_probe.py /stacks``) put 0.4-0.75 s into the first tiny CPU op (the
rope table's), then more into the first CUDA op, cuBLAS call and concatenation, all on the
start's critical path. ``start(device)`` runs ops of each kind on a daemon thread (torch
releases the GIL inside an op, so the imports go on beside it). When ``preload`` was given a CUDA
device (the CLI and servers do), it starts when ``executor.runner`` is imported, right after
torch and before the rest of the engine (``LLM``, ``freetoken generate`` and servers all import
it); otherwise when the engine's start begins. ``wait()`` joins it; the decode graphs' capture waits first, since
a capture must not see another thread's CUDA calls. Nothing the engine computes comes from this
thread; a failure here only means the engine's own first calls pay as before (``status()`` says
what happened).
"""
from __future__ import annotations

import threading
import time

from ..packed import early_cuda

_lock = threading.Lock()
_thread: threading.Thread | None = None
_status: dict = {}


def start(device: str | None) -> threading.Thread | None:
    """Warm torch for ``device`` in the background; None (nothing done) unless it is a CUDA
    device, or when a warm-up was already started in this process."""
    global _thread
    n = early_cuda.ordinal(device)
    if n is None:
        return None
    with _lock:
        if _thread is not None:
            return None
        _thread = threading.Thread(target=_warm, args=(n,), name="ft-torch-warm", daemon=True)
        _thread.start()
        return _thread


def start_after_preload() -> threading.Thread | None:
    """``start`` for the device ``preload`` made a CUDA context for, if any."""
    return start(early_cuda.started_device())


def wait() -> dict:
    """Join the warm-up if one runs; -> ``status()``."""
    t = _thread
    if t is not None and t is not threading.current_thread():
        t.join()
    return status()


def status() -> dict:
    """{"device": N, "seconds": ..., "error": None or why}; {} when none was started."""
    return dict(_status)


def _warm(n: int) -> None:
    t0 = time.perf_counter()
    _status.update(device=n, seconds=None, error=None)
    try:
        import torch
        dev = torch.device("cuda", n)
        # the CPU ops of the rope table, then the device: init, a copy, elementwise, cat, cuBLAS
        inv = 1.0 / (1e6 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
        freqs = torch.arange(64, device=dev).float()[:, None] * inv.to(dev)[None, :]
        table = (torch.cat((freqs, freqs), dim=-1).cos() * 1.0).to(torch.bfloat16)
        weight = torch.ones(128, table.shape[1], device=dev, dtype=torch.bfloat16)
        torch.nn.functional.linear(table, weight).float().sum().item()
        _status["seconds"] = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - a head start only: the engine's own calls do it anyway
        _status["error"] = f"{type(exc).__name__}: {exc}"
