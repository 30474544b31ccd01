"""Triton's once-per-process costs, paid beside the model's construction, or not at all on a
restart, instead of inside the first decode step.

The first kernel a process launches makes Triton compute its cache key's base, a hash of its
own compiler: ``triton_key()`` reads and hashes ``libtriton.so`` (about 500 MB) and its Python
sources, then caches it for the process; the backend's part of the key asks ``ptxas`` for its
version (a subprocess). The engine's first Triton launch is inside the decode graphs' warm-up, the
last step before ready. ``start()`` does both on a background thread when the engine's start
begins, and keeps the key in the engine's cache directory, stamped with the size and mtime of
every file the key hashes (``stamp``): a restart installs the stored key in about a millisecond
and reads none of those files. That matters beyond the hash: a restart reads its expert bank from the
same disk at the same time, and 500 MB read beside it cost the bank's read that much disk time
while the hash itself waited behind the bank's queue (device run 77: the first launch still
computed the key, 0.3-0.4 s into the capture). Triton's own compile workers install a key the
same way (``triton.runtime.cache.triton_key = lambda: key``). Anything missing (no Triton,
another version without that function, an unwritable cache) leaves the first launch to compute
it as before.
"""
from __future__ import annotations

import hashlib
import importlib
import logging
import os
import threading
import time
from pathlib import Path

from ...cachefile import read_json, write_json

log = logging.getLogger(__name__)

# where Triton versions keep the function (3.3+: runtime.cache; before: compiler.compiler), and
# the modules that call it through their own global name
_HOMES = ("triton.runtime.cache", "triton.compiler.compiler")
_USERS = _HOMES + ("triton.runtime.autotuner",)


def _key_function():
    for home in _HOMES:
        try:
            fn = getattr(importlib.import_module(home), "triton_key", None)
        except ImportError:
            continue
        if callable(fn):
            return fn
    return None


def stamp(root: Path) -> str:
    """A digest of (path, size, mtime) of what triton_key hashes, as Triton 3.x lays it out: the
    ``.py`` files of the packages under ``root``'s compiler/, backends/, language/ and runtime/
    (the function's own module), and ``_C/libtriton.*``. Any of them that changes, changes it;
    directories that are not packages (the bundled CUDA headers and tools) are not walked."""
    h = hashlib.sha256()

    def add(path: str) -> None:
        try:
            st = os.stat(path)
        except OSError:
            return
        h.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    for top in ("compiler", "backends", "language", "runtime"):
        for dirpath, dirnames, filenames in os.walk(root / top):
            dirnames[:] = sorted(d for d in dirnames
                                 if os.path.exists(os.path.join(dirpath, d, "__init__.py")))
            for name in sorted(filenames):
                if name.endswith(".py"):
                    add(os.path.join(dirpath, name))
    lib = root / "_C"
    for name in sorted(os.listdir(lib)) if lib.is_dir() else ():
        if name.startswith("libtriton"):
            add(str(lib / name))
    return h.hexdigest()


def stored_key(root: Path, compute, cache: Path) -> tuple[str, bool]:
    """``compute()``'s result for the files under ``root`` as they are now: read from ``cache``
    when it was stored for the same stamp, else computed and stored (atomically; an unwritable
    cache only costs the computation next time). -> (key, whether it was read)."""
    digest = stamp(root)
    path = cache / f"{digest[:24]}.json"
    got = read_json(path)
    if isinstance(got, dict) and got.get("stamp") == digest and isinstance(got.get("key"), str):
        return got["key"], True
    key = compute()
    try:
        write_json(path, {"stamp": digest, "key": key})
    except OSError as exc:
        log.debug("Triton's cache key was not stored (%s)", exc)
    return key, False


def _install(original, key: str) -> None:
    """Every module that calls ``original`` through its global name gets the stored key instead."""
    def triton_key() -> str:
        return key
    for name in _USERS:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(mod, "triton_key", None) is original:
            mod.triton_key = triton_key


def _warm_backend() -> None:
    """The backend's hash (ptxas's version, asked once per process) for the current device."""
    from triton.compiler.compiler import make_backend
    from triton.runtime.driver import driver
    make_backend(driver.active.get_current_target()).hash()


def _compute(done: dict, cache: Path, backend: bool) -> None:
    t0 = time.perf_counter()
    try:
        fn = _key_function()
        if fn is not None:
            import triton
            key, done["stored"] = stored_key(Path(triton.__file__).parent, fn, cache)
            _install(fn, key)
            done["seconds"] = time.perf_counter() - t0
        if backend:
            _warm_backend()
            done["backend_seconds"] = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - only a head start: the first launch does it anyway
        log.debug("Triton's cache key was not made ahead (%s)", exc)


def start(cache: Path | None = None, backend: bool = True) -> tuple[threading.Thread, dict]:
    """Make Triton's cache key (and, with ``backend``, the GPU backend's hash) on a daemon thread;
    ``cache``: the folder that keeps the key between processes (default: the engine's cache
    directory's ``triton-key``). -> (the thread, {"seconds": ..., "stored": whether the key was
    read from the cache, "backend_seconds": ...} as each is done)."""
    if cache is None:
        from ...env import cache_dir
        cache = cache_dir() / "triton-key"
    done: dict = {}
    t = threading.Thread(target=_compute, args=(done, cache, backend), name="ft-triton-key", daemon=True)
    t.start()
    return t, done
