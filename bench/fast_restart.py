"""Restart to first token: ``fast_load.py --first-request-only`` (a new process per restart,
``restart_probe.py``), against the disk's read of the same folder in the same run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from disk_read import drop_caches, evict, parallel_direct_read

PROBE = Path(__file__).resolve().parent / "restart_probe.py"


def first_request(folder: Path, threads: int, restarts: list[str], pycache: Path | None = None) -> dict:
    """A restart as a user sees it: a new process (imports included) loads the packed folder with
    ``LLM`` and serves its first request at once, cold expert cache, no warm-up pass; then a
    second request for comparison (32-token prompt, 8 new tokens each). Two processes, the page
    cache dropped before each: the first start on this folder (the CRC pass, and on a new machine
    the kernel build and q* calibration) and restarts, against the disk's parallel O_DIRECT
    read of the same files measured in the same run. ``restarts``: one process each, in order,
    "plain" (``LLM(folder)``) or "preload[:N]" (the process calls
    ``freetoken_engine.preload(folder[, N threads], device=...)`` before importing torch, as
    ``freetoken generate`` / ``serve`` do), followed by A/B switches of ``restart_probe.py``
    ("/serial", "/nocuda", "/allwidths": an earlier order of the start, each), and then:
    "+warm": a throwaway process imports torch, Triton and the engine after the page cache is
    dropped, so the libraries' imported parts come from memory and the rest (CUDA kernels,
    cuBLAS, Triton's compiler and cache) from the disk with the bank, as after a reboot;
    "+hot": the page cache is not dropped, only the folder's files are evicted from it, so the
    libraries are where the previous process (the last start) left them, as on a machine that
    ran the engine before (the bank's O_DIRECT reads never fill the page cache); neither: the
    whole page cache dropped. Each restart's first tokens are compared with the first start's.
    ``pycache``: Python writes and reads its bytecode there (``PYTHONPYCACHEPREFIX``), for a
    Python install that ships no ``.pyc`` files and cannot be written to, where every import
    compiles its source again (the GPU machine's torch: 2.6 s a start, device run 57's
    profile); a user's ``pip install`` writes them once."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    files = sorted(folder.glob("*.bin"))
    nbytes = sum(f.stat().st_size for f in files)
    drop_caches()
    t = time.perf_counter()
    parallel_direct_read(files, threads)
    disk_s = time.perf_counter() - t
    out = {"device": device, "disk_read_seconds": disk_s, "disk_gbps": nbytes / disk_s / 1e9,
           "bytecode_cache": str(pycache) if pycache is not None else None}
    first_tokens = None
    for i, mode in enumerate(["plain"] + restarts):
        start = "first_start" if i == 0 else f"restart_{i}_{mode}"
        hot = mode.endswith("+hot")
        dropped = evict(folder) if hot else drop_caches()
        mode = mode.removesuffix("+hot")
        warm = mode.endswith("+warm")
        if warm:                        # the libraries back in the page cache, the bank not
            subprocess.run([sys.executable, "-c", "import torch, triton, freetoken_engine.llm"], check=True, env=env)
            mode = mode.removesuffix("+warm")
        r = subprocess.run([sys.executable, str(PROBE), str(folder), device, mode],
                           capture_output=True, text=True, env=env)
        if r.returncode != 0:
            out[start] = {"error": r.stderr.strip().splitlines()[-40:] if r.stderr.strip() else "failed"}
            print(f"{start}: failed\n" + "\n".join(out[start]["error"]) if r.stderr.strip() else f"{start}: failed")
            continue
        res = json.loads(r.stdout.strip().splitlines()[-1])
        tokens = res.pop("first_tokens")
        res["same_tokens_as_first_start"] = tokens == first_tokens if i else None
        first_tokens = tokens if i == 0 else first_tokens
        out[start] = {"mode": mode, "libraries_warm": "hot" if hot else warm,
                      ("folder_evicted" if hot else "page_cache_dropped"): dropped, **res, "ready_over_disk_read": res["ready_seconds"] / disk_s}
        ld, tl = res["load"], res["timeline"]
        print(f"{start}: ready {res['ready_seconds']:.2f} s (imports {res['import_seconds']:.2f} s, load "
              f"{ld['seconds']:.2f} s of which waiting for the read {ld['waited_seconds']:.2f} s, read "
              f"{tl.get('read_started', 0):.2f}-{tl.get('read_finished', 0):.2f} s, graph capture "
              f"{tl.get('graphs_started', 0):.2f}-{tl.get('graphs_finished', 0):.2f} s "
              f"({res.get('graphs_at_ready')} graphs), model built {tl.get('start_model_called', 0):.2f}-"
              f"{tl.get('start_model_returned', 0):.2f} s, CUDA context made early in "
              f"{res.get('early_cuda', {}).get('seconds') or 0:.2f} s, pin after the read "
              f"{ld.get('pin_after_read_seconds') or 0:.2f} s; "
              f"{res['ready_seconds'] / disk_s:.2f}x the disk read of "
              f"{disk_s:.2f} s), first request {res['first_request_seconds']:.2f} s (cold cache "
              f"{res['first_request_stats']}), second {res['second_request_seconds']:.2f} s ({device}); "
              f"same tokens as the first start: {res['same_tokens_as_first_start']}")
    drop_caches()                       # the disk's speed drifts: read it again after the restarts
    t = time.perf_counter()
    parallel_direct_read(files, threads)
    out["disk_read_after_seconds"] = time.perf_counter() - t
    print(f"disk read: {disk_s:.2f} s before the starts, {out['disk_read_after_seconds']:.2f} s after")
    return out


def plot_restarts(entry: dict, title: str, path: Path) -> None:
    """Each start of ``entry`` (``first_request``'s result) as a bar of its time to ready, split
    into the read of the bank and what came after it, against the disk's reads of the same run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    starts = [(k, v) for k, v in entry.items() if k.startswith("restart_") and "ready_seconds" in v]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(starts) + 1.6))
    for i, (name, v) in enumerate(starts):
        read_end = min(v["timeline"].get("read_finished", v["ready_seconds"]), v["ready_seconds"])
        ax.barh(i, read_end, color="tab:gray")
        ax.barh(i, v["ready_seconds"] - read_end, left=read_end, color="tab:red")
        ax.text(v["ready_seconds"] + 0.05, i, f"{v['ready_seconds']:.2f} s", va="center", fontsize=7)
    disk = [entry["disk_read_seconds"]] + ([entry["disk_read_after_seconds"]] if "disk_read_after_seconds" in entry else [])
    for d in disk:
        ax.axvline(d, color="k", ls=":", lw=1)
    ax.set_yticks(range(len(starts)), [n.removeprefix("restart_") for n, _ in starts], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the process's start (gray: until the bank's read ended; red: after it; "
                  "dotted: the disk's own read)", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
