"""Build-on-first-use loader for the compiled CPU expert kernel.

``load()`` returns a ``ctypes.CDLL`` of ``libftexperts.so``, compiled from the C++ sources next to
this file with the system ``g++`` (or ``$CXX``) the first time it is needed, and cached under
``<engine cache>/cpu_kernel/<hash>/`` (``env.cache_dir()``: ``$FREETOKEN_CACHE_DIR``, else
``$XDG_CACHE_HOME/freetoken``, else ``~/.cache/freetoken``), keyed by the SHA-256 of the sources
and the build flags. A cached library is reused without any compiler, so a prebuilt
cache directory can be shipped to a machine that has none. Parallel first uses (test workers,
several engines) are serialised by a file lock; the library is published with an atomic rename.

One library holds every instruction-set variant (generic, AVX2, AVX-512, AVX-512-BF16, AMX); the C++
dispatcher picks one by cpuid at run time. ``BuildError`` is raised when no compiler is found or
the build fails; the caller (``cpu_experts``) turns that into one warning and the reference path.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SRC_DIR = Path(__file__).resolve().parent
SOURCES = ("experts.h", "simd.h", "gate.h", "rows_bf.h", "experts.cpp", "experts_isa.cpp", "decode_isa.cpp",
           "branch.cpp", "pool.h", "isa.h", "tune.h", "jobs.h", "amx_pack.h", "exp_job.h", "experts_amx.cpp",
           "mxfp4.h", "layer.cpp", "entry.h", "state.h", "call.h")
LIB_NAME = "libftexperts.so"

_COMMON = ["-O3", "-std=c++17", "-fPIC", "-fno-strict-aliasing", "-w"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = _AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
# (object name, source, extra flags): the same kernel source compiled once per instruction set.
_UNITS = (
    ("dispatch.o", "experts.cpp", []),
    ("branch.o", "branch.cpp", []),
    ("layer.o", "layer.cpp", []),
    ("isa_generic.o", "experts_isa.cpp", ["-DFT_ISA=0"]),
    ("isa_avx2.o", "experts_isa.cpp", ["-DFT_ISA=1"] + _AVX2),
    ("isa_avx512.o", "experts_isa.cpp", ["-DFT_ISA=2"] + _AVX512),
    ("isa_avx512bf16.o", "experts_isa.cpp", ["-DFT_ISA=3"] + _AVX512 + ["-mavx512bf16"]),
    ("isa_amx.o", "experts_amx.cpp", ["-DFT_ISA=3"] + _AVX512 + ["-mavx512bf16", "-mamx-tile", "-mamx-bf16"]),
    ("decode_generic.o", "decode_isa.cpp", ["-DFT_ISA=0"]),
    ("decode_avx2.o", "decode_isa.cpp", ["-DFT_ISA=1"] + _AVX2),
    ("decode_avx512.o", "decode_isa.cpp", ["-DFT_ISA=2"] + _AVX512),
    ("decode_avx512bf16.o", "decode_isa.cpp", ["-DFT_ISA=3"] + _AVX512 + ["-mavx512bf16"]),
)
# Static C++ runtime: the cached library then loads on hosts with another libstdc++.
_LINK = ["-shared", "-pthread", "-static-libstdc++", "-static-libgcc"]


class BuildError(RuntimeError):
    """No compiler, or the compiler rejected the sources; the message says which."""


def source_hash() -> str:
    """SHA-256 (16 hex digits) of the sources and flags: the cache key."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode())
        h.update((SRC_DIR / name).read_bytes())
    h.update(repr((_COMMON, _UNITS, _LINK)).encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where the built library lives: ``<engine cache dir>/cpu_kernel/<hash>``."""
    from ... import env
    return env.cache_dir() / "cpu_kernel" / source_hash()


def compiler() -> str | None:
    """The C++ compiler to use: ``$CXX`` if set, else ``g++``; None when neither is found."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _compile(cxx: str, out_dir: Path) -> Path:
    """Compile every unit in parallel into ``out_dir`` and link; returns the library path."""
    def one(unit: tuple[str, str, list[str]]) -> Path:
        obj, src, flags = unit
        dst = out_dir / obj
        cmd = [cxx, *_COMMON, *flags, "-c", str(SRC_DIR / src), "-o", str(dst)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        return dst

    with ThreadPoolExecutor(max_workers=len(_UNITS)) as pool:
        objs = list(pool.map(one, _UNITS))
    lib = out_dir / LIB_NAME
    cmd = [cxx, *_LINK, "-o", str(lib), *map(str, objs)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"link failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return lib


def library_path() -> Path:
    """Path of the cached library, building it first if it is missing (raises BuildError)."""
    target_dir = cache_dir()
    target = target_dir / LIB_NAME
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    with open(target_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same hash
        if target.exists():
            return target
        cxx = compiler()
        if cxx is None:
            raise BuildError(f"no C++ compiler found (looked for {os.environ.get('CXX', 'g++')!r})")
        with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
            lib = _compile(cxx, Path(tmp))
            os.replace(lib, target)  # atomic: readers see the whole library or none
    return target


def load() -> ctypes.CDLL:
    """Build if needed, load, and declare the C signatures (ctypes releases the GIL per call)."""
    lib = ctypes.CDLL(str(library_path()))
    i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.ft_best_isa.restype = ci
    lib.ft_has_amx.restype = ci
    lib.ft_isa_name.restype = ctypes.c_char_p
    lib.ft_isa_name.argtypes = [ci]
    lib.ft_last_error.restype = ctypes.c_char_p
    lib.ft_configure.restype = ci
    lib.ft_configure.argtypes = [ci, ctypes.POINTER(ci), ci, ci, i64, i64, ci]
    lib.ft_experts_range.restype = ci
    lib.ft_experts_range.argtypes = [vp, ci, i64, i64, i64, vp, vp, ci, i64, i64, i64, i64, i64, vp, vp, i64, vp, i64]
    lib.ft_experts_gated.restype = ci
    lib.ft_experts_gated.argtypes = [vp, ci, i64, i64, i64, vp, vp, ci, i64, i64, i64, i64, i64, vp, vp, i64, vp,
                                     ci, ctypes.c_float, ctypes.c_float, vp, i64, vp]
    lib.ft_experts_act.restype = ci
    lib.ft_experts_act.argtypes = [vp, ci, i64, i64, i64, vp, vp, ci, i64, i64, i64, i64, i64, vp, vp, i64, vp]
    lib.ft_linear.restype = ci
    lib.ft_linear.argtypes = [vp, ci, i64, i64, vp, ci, i64, i64, vp, vp]
    lib.ft_rmsnorm.restype = ci
    lib.ft_rmsnorm.argtypes = [vp, i64, i64, vp, ctypes.c_float, ci, vp]
    lib.ft_combine.restype = ci
    lib.ft_combine.argtypes = [vp, vp, vp, vp, vp, i64, i64, i64, ci]   # rows, w, shared, res, out, T, k, H, bf16
    lib.ft_attn.restype = ci
    lib.ft_attn.argtypes = [vp]          # FtAttn* (kernels/cpu/attention.py)
    lib.ft_layer_attn.restype = ci
    lib.ft_layer_attn.argtypes = [vp, vp, vp, vp, vp]   # FtLayer*, FtStep*, h, k_cache, v_cache (cpu/layer.py)
    lib.ft_layer_moe.restype = ci
    lib.ft_layer_moe.argtypes = [vp, i64, vp, vp, vp, vp, vp]  # FtLayer*, rows, ids, weights, shared, x2, h2
    lib.ft_branch_run.restype = ci
    lib.ft_branch_run.argtypes = [vp, i64]   # FtBranch* (kernels/cpu_branch.py), epoch
    lib.ft_read_seconds.restype = ctypes.c_double
    lib.ft_read_seconds.argtypes = [vp, i64]
    lib.ft_experts_loop.restype = ctypes.c_double
    lib.ft_experts_loop.argtypes = [vp, ci, i64, i64, i64, vp, vp, ci, i64,
                                    i64, i64, i64, i64, vp, vp, i64, i64, vp, i64]
    lib.ft_tune.restype = i64
    lib.ft_tune.argtypes = [ctypes.c_char_p, i64]
    lib.ft_last_timing.restype = None
    lib.ft_last_timing.argtypes = [ctypes.POINTER(ctypes.c_double)]
    lib.ft_pool_stats.restype = None
    lib.ft_pool_stats.argtypes = [ctypes.POINTER(i64)]
    lib.ft_pool_entries.restype = ci
    lib.ft_pool_entries.argtypes = [ctypes.POINTER(i64), ci]
    return lib
