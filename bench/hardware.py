"""Names the machine a benchmark ran on (CPU model, cores, flags of interest, GPU, versions)."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def describe() -> dict:
    cpu, flags = platform.processor() or "unknown", []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in have)
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "cpu_flags": flags, "python": platform.python_version(),
            "load_average_1m": round(os.getloadavg()[0], 2)}   # other work sharing the machine
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def peak_rss() -> int:
    """This process's peak resident bytes so far (``VmHWM``). Not ``ru_maxrss``: a process started
    by another carries its parent's peak there over the fork and exec (a worker whose parent built
    a 1.4 GB checkpoint starts at 1.4 GB), so growth measured with it reads too small."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")
