"""Triton's once-per-process cost, paid beside the model's construction instead of inside the
first decode step.

The first kernel a process launches makes Triton compute its cache key's base, a hash of its
own compiler: ``triton_key()`` reads and hashes ``libtriton.so`` and its Python sources (0.7 s on
the H200 host, device run 57's profile of a restart), then caches it for the process. The
engine's first Triton launch is inside the decode graphs' warm-up, the last step before ready,
so that time was on the start's critical path. ``start()`` imports Triton and computes the key
on a background thread when the engine's start begins (file reads and hashing release the GIL),
so the warm-up finds it made. Anything missing (no Triton, another version without that
function) leaves the first launch to compute it as before.
"""
from __future__ import annotations

import importlib
import logging
import threading
import time

log = logging.getLogger(__name__)

# where Triton versions keep the function (3.3+: runtime.cache; before: compiler.compiler)
_HOMES = ("triton.runtime.cache", "triton.compiler.compiler")


def _key_function():
    for home in _HOMES:
        try:
            fn = getattr(importlib.import_module(home), "triton_key", None)
        except ImportError:
            continue
        if callable(fn):
            return fn
    return None


def _compute(done: dict) -> None:
    t0 = time.perf_counter()
    try:
        fn = _key_function()
        if fn is not None:
            fn()
            done["seconds"] = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - only a head start: the first launch does it anyway
        log.debug("Triton's cache key was not computed ahead (%s)", exc)


def start() -> tuple[threading.Thread, dict]:
    """Compute Triton's cache key base on a daemon thread; -> (the thread, {"seconds": ...} once
    it was computed)."""
    done: dict = {}
    t = threading.Thread(target=_compute, args=(done,), name="ft-triton-key", daemon=True)
    t.start()
    return t, done
