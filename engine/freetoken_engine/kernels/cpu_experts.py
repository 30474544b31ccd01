"""Compiled CPU expert kernel: ``experts_forward`` at host-memory bandwidth.

Same contract as ``reference.expert_pairs_forward`` (read its docstring): for pairs
``(pair_tok[p], pair_exp[p])`` returns ``y[p] = W2[e] (silu(W1[e] x[t]) * W3[e] x[t])``, shape
``[P, H]`` in ``x.dtype``. Pairs are grouped by expert so each expert's weights are streamed once;
the gate/up projection, SwiGLU and down projection are fused; accumulation is fp32.

Supported by the compiled path: CPU tensors, ``x`` float32 or bfloat16 (``[T, H]``), ``w13``/``w2``
both float32 or both bfloat16 with unit stride in the last dimension (bank layers and cache slot
pools qualify; expert and row strides are passed through, nothing is copied). Anything else
(other dtypes or devices, tensors that need grad) goes to the reference, silently, because the
result is the same. With ``x`` in bfloat16 the kernel rounds the gate/up outputs, the SiLU and the
product to bfloat16 exactly where the reference does.

Tolerance against the reference (tested): fp32 ``x``: ``|y - ref| <= 1e-4 * max|ref| + 1e-5``
(summation order only); bf16 ``x``: ``|y - ref| <= 2e-2 * max|ref|`` (a bf16 ulp of an
intermediate may round the other way).

Threads: ``threads`` participants, the calling thread included (it is released from the GIL and
does a share); the other ``threads - 1`` are pinned to the *last* CPUs of the process affinity
set, so the first CPUs stay free for the engine. Default (``default_threads``): every CPU without
a GPU, all but one with a GPU. ``FREETOKEN_CPU_EXPERT_THREADS`` overrides the default;
``FREETOKEN_CPU_KERNEL`` = ``off`` forces the reference, = ``generic|avx2|avx512|avx512bf16|amx``
forces an instruction set (default ``auto``: the best one cpuid and the OS allow).
``configure()`` changes all of these at run time.

AMX (``amx``: Intel CPUs with AMX-BF16, Linux granting the tile state): groups of at least 4
tokens on one expert (bf16 ``x`` and weights, H and I multiples of 32) run on the tiles, the rest
on the AVX-512-BF16 kernels. Such a group sums in another order, so on an AMX machine a pair's
output can depend, in its last bits, on whether 4 or more tokens of the call share its expert;
it never depends on the thread count or on other experts' pairs. ``configure(isa="avx512bf16")``
turns the tiles off.

The library is built on first use (``kernels/cpu/build.py``); without a compiler (or when the
build fails) one warning line is logged and every call uses the reference.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os
import threading
from dataclasses import dataclass

import torch

from . import reference
from .cpu import gated
from .cpu.expert_args import as_int64, check_problem, compiled_ok, fast_args, problem_args, values

log = logging.getLogger(__name__)

from ..env import FREETOKEN_CPU_EXPERT_THREADS as ENV_THREADS  # noqa: E402,F401  (declared in env.py)
from ..env import FREETOKEN_CPU_KERNEL as ENV_KERNEL  # noqa: E402
from ..env import cpu_expert_threads  # noqa: E402
ISAS = ("generic", "avx2", "avx512", "avx512bf16", "amx")


@dataclass(frozen=True)
class KernelConfig:
    """Run-time settings of the compiled kernel; validated on construction."""

    threads: int
    isa: str = "auto"            # "auto" or one of ISAS
    prefetch_bytes: int = 4096   # software prefetch distance along bf16 weight rows; 0 = off
    # One bf16 row of H 2048 ahead. bench/results/cpu_expert_kernel.json: on the 16-core Xeon
    # 0 -> 512 -> 1024 gave 77 -> 87 -> 92 GB/s (larger not measured there); on the 2-CPU EPYC
    # 4096 beat 1024 for one token (79% vs 74% of read) and for 8 tokens (53% vs 37%). With rows
    # streamed one at a time in address order (simd.h dotr), the H200 host's Xeon gave, for one
    # bf16 token at 15 threads, 93 / 101 / 108 GB/s at 0 / 1024 / 4096 (best of 3 rounds; the
    # interleaved-row kernel before it: 83 / 97 / 98). The EPYC's fp32 rows read faster without
    # (SmolLM2's matrices in C++: 40 vs 36-37 GB/s; its decode +5-8% in 2 of 3 paired runs,
    # -2% in one), hence a separate setting for fp32 rows.
    spin_us: int = 200           # how long idle workers spin before sleeping
    prefetch_fp32_bytes: int = 0  # the same along fp32 weight rows

    def __post_init__(self) -> None:
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be a positive int, got {self.threads!r}")
        if self.isa != "auto" and self.isa not in ISAS:
            raise ValueError(f"isa must be 'auto' or one of {ISAS}, got {self.isa!r}")
        for name in ("prefetch_bytes", "prefetch_fp32_bytes"):
            v = getattr(self, name)
            if v < 0 or v % 64:
                raise ValueError(f"{name} must be a non-negative multiple of 64, got {v}")
        if self.spin_us < 0:
            raise ValueError(f"spin_us must be >= 0, got {self.spin_us}")


def gpu_present() -> bool:
    """A CUDA build of torch and an NVIDIA device node: asked without initialising CUDA (a
    process that forks later must not have touched the driver), so a GPU the driver would refuse
    still counts."""
    return torch.backends.cuda.is_built() and bool(glob.glob("/dev/nvidia[0-9]*"))


def default_threads() -> int:
    """Every CPU of the affinity set without a GPU; all but one (at least one) with a GPU.

    Without a GPU the engine's thread has nothing to do while the experts compute (decode calls
    the kernel layer after layer), so it works as one of the participants and every CPU reads
    weights: on the 2-CPU EPYC the kernel reads 67.2 GB/s at 2 threads against 33.8 at 1, and the
    engine's bf16 CPU decode runs 172 against 108 tok/s (docs/cpu_kernel.md). With
    a GPU (``gpu_present``) one CPU is left to the engine's own work (kernel launches, the CPU
    branch's host loop)."""
    explicit = cpu_expert_threads()
    if explicit is not None:
        return explicit
    n = len(os.sched_getaffinity(0))
    return max(1, n - 1) if gpu_present() else n


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_loaded = False
_isa = "reference"
_config: KernelConfig | None = None


def _load() -> ctypes.CDLL | None:
    """Load (building on first use) and configure the library once; None means reference."""
    global _lib, _loaded
    if _loaded:
        return _lib
    with _lock:
        if _loaded:
            return _lib
        mode = os.environ.get(ENV_KERNEL, "auto").strip().lower()
        if mode in ("off", "0", "reference"):
            log.info("CPU expert kernel disabled by %s=%s; using the PyTorch reference", ENV_KERNEL, mode)
        else:
            from .cpu import build
            try:
                _lib = build.load()
            except (build.BuildError, OSError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                log.warning("freetoken: compiled CPU expert kernel unavailable (%s); "
                            "using the PyTorch reference", first)
                _lib = None
        _loaded = True
        if _lib is not None:
            _apply(KernelConfig(threads=default_threads(), isa=mode if mode in ISAS else "auto"))
        return _lib


def _apply(cfg: KernelConfig) -> None:
    global _isa, _config
    cpus = sorted(os.sched_getaffinity(0))
    workers = cpus[len(cpus) - (cfg.threads - 1):] if 1 < cfg.threads <= len(cpus) else cpus
    arr = (ctypes.c_int * max(1, len(workers)))(*workers)
    isa = -1 if cfg.isa == "auto" else ISAS.index(cfg.isa)
    rc = _lib.ft_configure(cfg.threads, arr, len(workers), isa, cfg.prefetch_bytes, cfg.prefetch_fp32_bytes,
                           cfg.spin_us)
    if rc < 0:
        raise ValueError(_lib.ft_last_error().decode())
    _isa, _config = ISAS[rc], cfg


def configure(threads: int | None = None, isa: str | None = None,
              prefetch_bytes: int | None = None, spin_us: int | None = None,
              prefetch_fp32_bytes: int | None = None) -> KernelConfig:
    """Change thread count, instruction set, prefetch or spin at run time; returns the config.

    Raises ValueError for a bad value or an instruction set this CPU lacks; a no-op returning
    the default config when only the reference is available.
    """
    if _load() is None:
        return KernelConfig(threads=threads or default_threads())
    cur = _config
    cfg = KernelConfig(threads=cur.threads if threads is None else threads,
                       isa=cur.isa if isa is None else isa,
                       prefetch_bytes=cur.prefetch_bytes if prefetch_bytes is None else prefetch_bytes,
                       prefetch_fp32_bytes=(cur.prefetch_fp32_bytes if prefetch_fp32_bytes is None
                                            else prefetch_fp32_bytes),
                       spin_us=cur.spin_us if spin_us is None else spin_us)
    with _lock:
        _apply(cfg)
    return cfg


TUNING_KNOBS = ("chunks_per_thread", "amx_min_tokens", "amx_pf", "amx_next", "far_pf", "far_pf_tokens",
                "small_far_pf", "linear_far_pf", "linear_far_tokens", "linear_pair_tokens", "linear_row_group",
                "read_chunk",
                "stall_us", "backoff_ms", "backoff_max_ms", "test_stall_us")


def tune(**knobs: int) -> dict:
    """Set tuning knobs of the compiled kernel (kernels/cpu/tune.h; the defaults are the measured
    best), e.g. ``tune(chunks_per_thread=8)``, for sweeps such as ``bench/cpu_kernel_tune.py``;
    returns every knob's value after the change ({} on the reference). Raises ValueError for an
    unknown knob or a value out of its range."""
    for name, value in knobs.items():
        if name not in TUNING_KNOBS:
            raise ValueError(f"unknown tuning knob {name!r}; known: {', '.join(TUNING_KNOBS)}")
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"tuning knob {name} must be a non-negative int, got {value!r}")
    lib = _load()
    if lib is None:
        return {}
    with _lock:
        for name, value in knobs.items():
            if lib.ft_tune(name.encode(), value) < 0:
                raise ValueError(lib.ft_last_error().decode())
        return {name: lib.ft_tune(name.encode(), -1) for name in TUNING_KNOBS}


def last_timing() -> dict:
    """The last compiled expert call's phases, microseconds from its start: ``posted`` (grouping
    done), ``last_start`` (the last participant began), ``stage1_end``, ``end``; {} on the reference."""
    lib = _load()
    if lib is None:
        return {}
    buf = (ctypes.c_double * 4)()
    lib.ft_last_timing(buf)
    return dict(zip(("posted", "last_start", "stage1_end", "end"), buf))


def pool_stats() -> dict:
    """The thread pool's record of CPUs shared with other processes (kernels/cpu/pool.h):
    ``workers_left_out`` (workers sitting out the jobs now, after holding a call up) and
    ``stalled_calls`` (calls so far that waited for such a worker, since the pool started); {}
    while the compiled kernel is not loaded (this never loads or builds it: metrics read it)."""
    lib = _lib if _loaded else None
    if lib is None:
        return {}
    buf = (ctypes.c_int64 * 2)()
    lib.ft_pool_stats(buf)
    return {"workers_left_out": buf[0], "stalled_calls": buf[1]}


def pool_entries() -> dict:
    """``jobs`` the pool has run and ``entered``, the jobs each worker took part in (worker 1
    first): a worker whose CPU another process shares takes part in fewer of them, without
    stalling any (the caller takes its chunks). {} while the compiled kernel is not loaded or
    before the pool's first job."""
    lib = _lib if _loaded else None
    if lib is None:
        return {}
    buf = (ctypes.c_int64 * 256)()
    n = lib.ft_pool_entries(buf, 256)
    return {"jobs": buf[0], "entered": list(buf[1:min(n, 256)])} if n else {}


def available() -> bool:
    """True when the compiled kernel is loaded (built on first use if needed)."""
    return _load() is not None


def backend_name() -> str:
    """``cpu-<isa>`` (e.g. ``cpu-avx512bf16``, ``cpu-amx``) for the compiled kernel, else ``reference``."""
    return f"cpu-{_isa}" if _load() is not None else "reference"


def cpu_features() -> dict:
    """What the dispatcher sees: best instruction set, AMX presence, the current config."""
    lib = _load()
    if lib is None:
        return {"backend": "reference"}
    return {"backend": backend_name(), "best_isa": ISAS[lib.ft_best_isa()],
            "amx": bool(lib.ft_has_amx()), "threads": _config.threads,
            "prefetch_bytes": _config.prefetch_bytes, "prefetch_fp32_bytes": _config.prefetch_fp32_bytes}


def _check_rows_from(rows_from: int, inter: int, w13: torch.Tensor) -> None:
    if not 0 <= rows_from < inter:
        raise ValueError(f"rows_from must be in [0, {inter}), got {rows_from}")
    if rows_from and w13.dtype == torch.uint8:
        raise ValueError(f"MXFP4 rows are computed as whole experts: rows_from must be 0, got {rows_from}")


def experts_forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    pair_tok: torch.Tensor, pair_exp: torch.Tensor,
                    out: torch.Tensor | None = None, rows_from: int = 0, act: reference.GatedAct = reference.SILU,
                    b13: torch.Tensor | None = None, pair_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[P, H]`` outputs of every (token, expert) pair; see the module docstring.

    ``act``, ``b13``, ``pair_bias``: experts of another kind (reference.expert_pairs_forward's
    arguments: gpt-oss), whole experts only (``gated_forward``).

    ``rows_from`` (0 <= rows_from < I): only the intermediate rows [rows_from, I) of each expert,
    the CPU's share of an expert whose rows [0, rows_from) a GPU computes from a streamed copy
    (the two partial sums add up to the expert's output). 0: the whole expert.

    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; pair_tok, pair_exp [P] integer. ``out``: an optional
    contiguous ``[P, H]`` CPU tensor of ``x.dtype`` (e.g. pinned) that the kernel writes in place
    and returns: no second copy, and no torch op between calls. (A torch copy of a large enough
    result runs on torch's OpenMP threads, which then spin for milliseconds on the CPUs the
    kernel's workers are pinned to: bench/cpu_expert_kernel.py's static-split rows.) Raises
    ValueError for inconsistent shapes or a bad ``out``, IndexError for an out-of-range index.
    """
    if act != reference.SILU or b13 is not None:
        if rows_from:
            raise ValueError("rows_from takes plain experts (silu, no biases)")
        return gated.gated_forward(_lib if _loaded else _load(), x, w13, w2, pair_tok, pair_exp, out, act, b13,
                                   pair_bias)
    lib = _lib if _loaded else _load()
    args = fast_args(x, w13, w2, pair_tok, pair_exp, out, rows_from) if lib is not None else None
    if args is not None and args[-1]:
        if out is None:
            out = torch.empty((args[-1], args[3]), dtype=x.dtype)
        if lib.ft_experts_range(*args, out.data_ptr(), rows_from) != 0:
            raise IndexError(lib.ft_last_error().decode())
        return out
    check_problem(x, w13, w2, pair_tok, pair_exp)
    H, I, P = x.shape[1], values(w2), pair_tok.numel()
    _check_rows_from(rows_from, I, w13)
    if out is not None and (out.shape != (P, H) or out.dtype != x.dtype or out.device.type != "cpu"
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous CPU [{P}, {H}] {x.dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if P == 0:
        return x.new_zeros((0, H)) if out is None else out
    if lib is None or not compiled_ok(x, w13, w2):
        if rows_from:
            w13 = torch.cat((w13[:, rows_from:I], w13[:, I + rows_from:]), 1)
            w2 = w2[:, :, rows_from:]
        y = reference.expert_pairs_forward(x, w13, w2, pair_tok, pair_exp)
        return y if out is None else out.copy_(y)
    x = x.contiguous()
    tok, exp = as_int64(pair_tok), as_int64(pair_exp)
    if out is None:
        out = torch.empty((P, H), dtype=x.dtype)
    rc = lib.ft_experts_range(*problem_args(x, w13, w2), tok.data_ptr(), exp.data_ptr(), P, out.data_ptr(), rows_from)
    if rc != 0:
        raise IndexError(lib.ft_last_error().decode())
    return out


def experts_act(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, pair_tok: torch.Tensor,
                pair_exp: torch.Tensor) -> torch.Tensor:
    """``[P, I]`` activations ``silu(W1[e] x[t]) * W3[e] x[t]`` of every pair (the first stage of
    ``experts_forward``, rounded where it rounds): a split by stage computes them here and the down
    projection elsewhere. Same arguments and errors as ``experts_forward``; the reference when the
    compiled kernel does not take the tensors."""
    check_problem(x, w13, w2, pair_tok, pair_exp)
    P, I = pair_tok.numel(), values(w2)
    lib = _load()
    if P == 0 or lib is None or not compiled_ok(x, w13, w2):
        return reference.expert_pairs_act(x, w13, pair_tok, pair_exp)
    x = x.contiguous()
    tok, exp = as_int64(pair_tok), as_int64(pair_exp)
    act = torch.empty((P, I), dtype=x.dtype)
    rc = lib.ft_experts_act(*problem_args(x, w13, w2), tok.data_ptr(), exp.data_ptr(), P, act.data_ptr())
    if rc != 0:
        raise IndexError(lib.ft_last_error().decode())
    return act


def calls_seconds(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, pair_tok: torch.Tensor,
                  pair_exps: torch.Tensor, rows_from: int = 0) -> float:
    """Seconds for ``len(pair_exps)`` expert calls run back to back from C, call c on the pairs
    (pair_tok, pair_exps[c]): the kernel's rate as the engine's C++ CPU branch sees it, with no
    Python call around each (a 1-expert call costs ~100 us on the H200 host, the Python call
    15-20 us more). ``rows_from``: each call computes the intermediate rows [rows_from, I) only
    (``experts_forward``'s). The GIL is released throughout. Needs the compiled kernel
    (RuntimeError)."""
    lib = _load()
    if lib is None or not compiled_ok(x, w13, w2):
        raise RuntimeError("calls_seconds needs the compiled CPU kernel and CPU bf16/fp32 tensors")
    if pair_exps.dim() != 2 or pair_tok.dim() != 1 or pair_exps.shape[1] != pair_tok.numel():
        raise ValueError(f"pair_exps must be [calls, P] and pair_tok [P], got {tuple(pair_exps.shape)}, "
                         f"{tuple(pair_tok.shape)}")
    _check_rows_from(rows_from, values(w2), w13)
    x = x.contiguous()
    tok, exps = as_int64(pair_tok), as_int64(pair_exps)
    out = torch.empty((tok.numel(), x.shape[1]), dtype=x.dtype)
    secs = lib.ft_experts_loop(*problem_args(x, w13, w2), tok.data_ptr(), exps.data_ptr(), tok.numel(),
                               exps.shape[0], out.data_ptr(), rows_from)
    if secs < 0:
        raise IndexError(lib.ft_last_error().decode())
    return secs


def read_seconds(buf: torch.Tensor) -> float:
    """Seconds to read ``buf`` once with the kernel's threads (the STREAM-style yardstick)."""
    lib = _load()
    if lib is None:
        raise RuntimeError("compiled CPU kernel unavailable")
    if not buf.is_contiguous() or buf.device.type != "cpu":
        raise ValueError("buf must be a contiguous CPU tensor")
    return lib.ft_read_seconds(buf.data_ptr(), buf.numel() * buf.element_size())
