"""Every environment variable the engine reads is declared here, and only here."""
from __future__ import annotations

import os
from pathlib import Path

#: Root of the engine's on-disk caches (converted default model, calibration results).
FREETOKEN_CACHE_DIR = "FREETOKEN_CACHE_DIR"
#: Number of CPU threads torch may use for the engine's CPU work (default: all cores). A CPU
#: engine runs its decode passes of at most 8 rows with one (executor/host_threads.py).
#: Importing the package defaults ``OMP_WAIT_POLICY=PASSIVE`` (idle OpenMP workers sleep).
FREETOKEN_CPU_THREADS = "FREETOKEN_CPU_THREADS"
#: Force the CPU expert backend: "reference" or a compiled backend's name.
FREETOKEN_CPU_EXPERT_BACKEND = "FREETOKEN_CPU_EXPERT_BACKEND"
#: Threads of the compiled CPU expert kernel (default: every CPU of the affinity set without a
#: GPU, all but one with a GPU; ``kernels/cpu_experts.default_threads``).
FREETOKEN_CPU_EXPERT_THREADS = "FREETOKEN_CPU_EXPERT_THREADS"
#: Compiled CPU expert kernel: "auto" (build on first use), "off"/"reference", or an ISA name.
FREETOKEN_CPU_KERNEL = "FREETOKEN_CPU_KERNEL"
#: C++ compiler for the CPU expert kernel (the usual variable; default g++).
CXX = "CXX"
#: Cross-layer expert prefetch in decode (layers/moe.py, cache/device_control.py ``prefetch``):
#: "on" guesses layer l + 1's experts with its router on layer l's router input and copies the
#: guessed misses ahead, while layer l computes, in decode calls of one sequence; "all" in every
#: decode call; "off" (the default). H200, 48 layers in Qwen3-30B's shapes, replayed routing:
#: 1.11x at batch 1 with every guess right, 1.04x with 90%, but 0.97x / 0.86x at batch 4, and how
#: well the next router guesses in a real model is not measured here (docs/gpu.md).
FREETOKEN_EXPERT_PREFETCH = "FREETOKEN_EXPERT_PREFETCH"
#: Fills behind the CPU in decode on a GPU (cache/behind.py): "on" (each layer call's idle PCIe
#: time, while the CPU computes its share of the misses, stages a slice of one CPU-computed expert
#: on the device; resident once every word is in) or "off" (the default: on the H100 hosts
#: measured the copies slowed the CPU kernel about as much as they saved, docs/gpu.md). Not with
#: FREETOKEN_EXPERT_PREFETCH.
FREETOKEN_FILL_BEHIND = "FREETOKEN_FILL_BEHIND"
#: Decode's CPU branch without a per-layer sync (cache/host_branch.py): "on", "off", or "auto"
#: (the default: on; "off" keeps the per-layer-sync path, for A/B measurements).
FREETOKEN_HOST_BRANCH = "FREETOKEN_HOST_BRANCH"
#: Decode's streamed split on a GPU (kernels/triton/stream.py): "on" (the first rows of up to
#: 8 CPU experts per layer also cross PCIe and run on the GPU; same fills), "floor" (also fill
#: only floor(q* m) of m misses, so no layer waits for PCIe), "stage" (the split by stage,
#: kernels/triton/stage.py: in 1-token calls, the whole W2 of up to 8 CPU experts per layer crosses
#: PCIe where PCIe would otherwise finish first, and their down projection runs on the GPU from the
#: host's activations; the q* fills unchanged) or "off".
#: Default: STREAM_SPLIT_DEFAULT.
FREETOKEN_STREAM_SPLIT = "FREETOKEN_STREAM_SPLIT"
STREAM_SPLIT_DEFAULT = "off"
#: The GPU decode's Triton kernels (kernels/triton/<name>.py): attention, RMSNorm (norm), the
#: router's selection (route), and the MoE combine with the residual adds fused into it and into
#: the next norm (combine), and the dense projections of 1-16 tokens (gemv: the attention's, the
#: router's, the shared expert's, the LM head's); for hybrid models a Gated DeltaNet layer's decode
#: step (deltanet) and its prefill chunks' state hand-over (deltanet_chunk): "on" (the default:
#: all), "off" (torch's ops) or a comma-separated list of those names (the others torch's ops),
#: for A/B measurements.
FREETOKEN_GPU_DECODE_KERNELS = "FREETOKEN_GPU_DECODE_KERNELS"
#: Fill admission of the expert cache under the q* split (cache/experts.py): "on" (the default:
#: a miss is filled only over a victim unused for a whole decode step, else computed on the CPU)
#: or "off" (plain LRU victims), for A/B measurements.
FREETOKEN_FILL_ADMISSION = "FREETOKEN_FILL_ADMISSION"
#: Bypass slots of the GPU expert cache (cache/experts.py): pool rows outside the LRU that a fill
#: refused by admission still crosses PCIe into, for its layer call only, so PCIe keeps its q*
#: share. An integer >= 0 (0: off); default BYPASS_SLOTS_DEFAULT, at most a quarter of the pool.
FREETOKEN_BYPASS_SLOTS = "FREETOKEN_BYPASS_SLOTS"
BYPASS_SLOTS_DEFAULT = 8
#: Prefill seeds the decode expert cache (cache/offload.py): "on" (the default: after each MoE
#: layer of a prefill on a GPU, the last token's experts are copied into the cache from the
#: prefill's whole-layer buffer, device to device) or "off", for A/B measurements.
FREETOKEN_PREFILL_SEED = "FREETOKEN_PREFILL_SEED"
#: The CLI's early read of a packed ``--model`` (packed/early.py): "auto" (the default: when the
#: process may use at least PRELOAD_MIN_CPUS CPUs, or the read maps the bank), "on" or "off". On
#: 2 CPUs a read's page faults take the CPU the imports need (docs/cpu_kernel.md); a mapped one's
#: do not.
FREETOKEN_PRELOAD = "FREETOKEN_PRELOAD"
PRELOAD_MIN_CPUS = 4
#: The expert bank's host memory on transparent huge pages (packed/memory.py): "on" (the default,
#: where the kernel grants them) or "off" (4 KiB pages), for A/B runs or a host where compaction
#: stalls.
FREETOKEN_HUGE_PAGES = "FREETOKEN_HUGE_PAGES"
#: A CPU engine's restart maps the packed bank's files instead of reading them into anonymous
#: memory (packed/early.py): "on" (the default) or "off". The kernel's page cache then is the
#: bank: read at the disk's speed with almost no CPU, but under memory pressure the kernel may
#: drop bank pages and read them again when they are used.
FREETOKEN_MAP_BANK = "FREETOKEN_MAP_BANK"
#: Default of ``serve --api-key`` / ``--admin-token``: secrets passed this way stay out of the
#: process list (``ps`` shows every argument), which is how the node agent passes them.
FREETOKEN_API_KEY = "FREETOKEN_API_KEY"
FREETOKEN_ADMIN_TOKEN = "FREETOKEN_ADMIN_TOKEN"


def cache_dir() -> Path:
    """``$FREETOKEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/freetoken``, else ``~/.cache/freetoken``."""
    explicit = os.environ.get(FREETOKEN_CACHE_DIR)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "freetoken"


def cpu_threads() -> int | None:
    value = os.environ.get(FREETOKEN_CPU_THREADS)
    return int(value) if value else None


def cpu_expert_backend() -> str | None:
    return os.environ.get(FREETOKEN_CPU_EXPERT_BACKEND) or None


def _mode(name: str, default: str, allowed: tuple[str, ...]) -> str:
    """The switch ``name`` (lower case, default ``default``); ValueError naming the allowed values
    for anything else."""
    mode = os.environ.get(name, default).strip().lower()
    if mode not in allowed:
        raise ValueError(f"{name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {mode!r}")
    return mode


def validate() -> None:
    """Parse every engine switch of this module now (ValueError naming the first bad one): the
    engine calls it at start, so a typo in a GPU-only setting fails on a CPU too, not on the first
    GPU that reads it."""
    for parse in (host_branch, gpu_decode_kernels, fill_admission, prefill_seed, stream_split, bypass_slots,
                  cpu_expert_threads, preload, huge_pages, map_bank, expert_prefetch, fill_behind):
        parse()


def cpu_expert_threads() -> int | None:
    """FREETOKEN_CPU_EXPERT_THREADS as an integer >= 1, or None when unset (the kernel's default,
    ``kernels/cpu_experts.default_threads``); ValueError for anything else."""
    raw = os.environ.get(FREETOKEN_CPU_EXPERT_THREADS)
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{FREETOKEN_CPU_EXPERT_THREADS} must be an integer, got {raw!r}") from None
    if n < 1:
        raise ValueError(f"{FREETOKEN_CPU_EXPERT_THREADS} must be >= 1, got {n}")
    return n


def host_branch() -> bool:
    """Whether the engine answers decode's CPU pairs from a host thread (see FREETOKEN_HOST_BRANCH)."""
    return _mode(FREETOKEN_HOST_BRANCH, "auto", ("auto", "on", "off")) != "off"


GPU_DECODE_KERNELS = ("attention", "norm", "route", "combine", "gemv", "deltanet", "deltanet_chunk")


def gpu_decode_kernels() -> frozenset[str]:
    """The Triton decode kernels GPU layers use (see FREETOKEN_GPU_DECODE_KERNELS); ValueError
    for an unknown name."""
    mode = os.environ.get(FREETOKEN_GPU_DECODE_KERNELS, "on").strip().lower()
    if mode in ("on", "off"):
        return frozenset(GPU_DECODE_KERNELS if mode == "on" else ())
    names = frozenset(n.strip() for n in mode.split(",") if n.strip())
    if not names <= set(GPU_DECODE_KERNELS):
        raise ValueError(f"{FREETOKEN_GPU_DECODE_KERNELS} must be on, off or a list of "
                         f"{', '.join(GPU_DECODE_KERNELS)}; got {mode!r}")
    return names


def expert_prefetch() -> int:
    """The largest decode call (tokens) that prefetches the next layer's guessed experts (see
    FREETOKEN_EXPERT_PREFETCH): 0 (off), 1 (on) or unbounded (all); ValueError for anything else."""
    return {"off": 0, "on": 1, "all": 1 << 30}[_mode(FREETOKEN_EXPERT_PREFETCH, "off", ("on", "all", "off"))]


def fill_behind() -> bool:
    """Whether decode fills behind the CPU (see FREETOKEN_FILL_BEHIND); ValueError for anything
    but on / off, or on beside the expert prefetch."""
    on = _mode(FREETOKEN_FILL_BEHIND, "off", ("on", "off")) == "on"
    if on and expert_prefetch():
        raise ValueError(f"{FREETOKEN_FILL_BEHIND}=on cannot run beside {FREETOKEN_EXPERT_PREFETCH}: turn one off")
    return on


def fill_admission() -> bool:
    """Whether the expert cache admits fills only over victims idle for a step (see
    FREETOKEN_FILL_ADMISSION); ValueError for anything but on / off."""
    return _mode(FREETOKEN_FILL_ADMISSION, "on", ("on", "off")) == "on"


def bypass_slots() -> int:
    """The GPU expert cache's bypass slots (see FREETOKEN_BYPASS_SLOTS); ValueError for anything
    but an integer >= 0."""
    value = os.environ.get(FREETOKEN_BYPASS_SLOTS, "").strip()
    if not value:
        return BYPASS_SLOTS_DEFAULT
    if not value.isdigit():
        raise ValueError(f"{FREETOKEN_BYPASS_SLOTS} must be an integer >= 0, got {value!r}")
    return int(value)


def prefill_seed() -> bool:
    """Whether a prefill seeds the decode expert cache (see FREETOKEN_PREFILL_SEED); ValueError
    for anything but on / off."""
    return _mode(FREETOKEN_PREFILL_SEED, "on", ("on", "off")) == "on"


def stream_split() -> str:
    """"on", "floor", "stage" or "off" (see FREETOKEN_STREAM_SPLIT); ValueError for anything else."""
    return _mode(FREETOKEN_STREAM_SPLIT, STREAM_SPLIT_DEFAULT, ("on", "floor", "stage", "off"))


def huge_pages() -> bool:
    """Whether the bank's arenas ask for transparent huge pages (see FREETOKEN_HUGE_PAGES);
    ValueError for anything but on / off."""
    return _mode(FREETOKEN_HUGE_PAGES, "on", ("on", "off")) == "on"


def map_bank() -> bool:
    """Whether a CPU engine's restart maps the bank's files (see FREETOKEN_MAP_BANK); ValueError
    for anything but on / off."""
    return _mode(FREETOKEN_MAP_BANK, "on", ("on", "off")) == "on"


def preload(mapped: bool = False) -> bool:
    """Whether the CLI reads a packed folder before importing torch (see FREETOKEN_PRELOAD);
    ValueError for anything but auto / on / off. ``mapped``: the read would map the bank
    (packed/early.py), which costs the imports no CPU, so "auto" reads early on any CPU count."""
    mode = _mode(FREETOKEN_PRELOAD, "auto", ("auto", "on", "off"))
    if mode != "auto":
        return mode == "on"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus >= PRELOAD_MIN_CPUS or mapped


def api_key() -> str | None:
    return os.environ.get(FREETOKEN_API_KEY) or None


def admin_token() -> str | None:
    return os.environ.get(FREETOKEN_ADMIN_TOKEN) or None
