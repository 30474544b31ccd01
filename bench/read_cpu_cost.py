"""What a cold read of a bank costs the CPUs: the engine's O_DIRECT reads into fresh memory
against mapping the files and asking the kernel to fill the mapping.

On a 2-CPU machine a restart is bound by ``import torch`` beside the bank's read
(docs/cpu_kernel.md): whatever CPU time the read takes, the imports lose. Sides, each after
the page cache is dropped, alternating over ``--rounds``:

* ``odirect``: the engine's read (``packed/early.py``): ``--threads`` threads, 64 MiB ``preadv``
  calls through O_DIRECT into one fresh page-aligned arena (``packed.memory.arena``: private,
  transparent huge pages advised), so every page of it is faulted in and zeroed by the kernel
  before the DMA lands;
* ``mmap``: each file mapped privately, ``--threads`` threads calling
  ``madvise(MADV_POPULATE_READ)`` on 64 MiB ranges (``packed.memory.populate``, the engine's call): the disk's DMA fills page-cache pages, which
  become the mapping's pages (nothing zeroed, nothing copied).

Reported per side: seconds, GB/s, the reader threads' CPU seconds (user + system, each
thread's own clock) and the whole process's; and, with ``--probe``, how fast a busy loop on the
main thread ran meanwhile against alone (what the read leaves to other work, such as the
start's imports; the process's CPU seconds then include the loop's).
Output: a table, ``bench/results/read_cpu_cost.json`` (an entry per ``--label``) and a PNG.

    python bench/read_cpu_cost.py --folder DIR --label NAME      # DIR: the files to read (*.bin)
    python bench/read_cpu_cost.py --make 4 --label NAME          # writes 4 GiB of test files first
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from disk_read import drop_caches  # noqa: E402
from hardware import describe  # noqa: E402

from freetoken_engine.packed.memory import arena, populate  # noqa: E402

CHUNK = 64 << 20


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


#: CPU seconds of the last read's worker threads (user + system, from each thread's own clock)
WORKER_CPU: list[float] = []


def _pool(jobs: list, threads: int, work) -> None:
    it, lock = iter(jobs), threading.Lock()
    WORKER_CPU.clear()

    def run():
        c0 = time.thread_time()
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                break
            work(*job)
        with lock:
            WORKER_CPU.append(time.thread_time() - c0)

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def read_odirect(files: list[Path], threads: int):
    sizes = [f.stat().st_size for f in files]
    dest = arena(sum(sizes))
    view = memoryview(dest)
    fds, jobs, base = [], [], 0
    for f, n in zip(files, sizes):
        fds.append(os.open(f, os.O_RDONLY | os.O_DIRECT))
        jobs += [(fds[-1], off, base + off, min(CHUNK, n - off)) for off in range(0, n, CHUNK)]
        base += n

    def work(fd, off, at, n):
        got = os.preadv(fd, [view[at:at + n]], off)
        if got != n:
            raise OSError(f"short read: {got} of {n}")
    try:
        _pool(jobs, threads, work)
    finally:
        for fd in fds:
            os.close(fd)
    view.release()
    return dest


def read_mmap(files: list[Path], threads: int):
    maps, jobs = [], []
    for f in files:
        n = f.stat().st_size
        fd = os.open(f, os.O_RDONLY)
        try:   # writable and private (copy on write), as the engine maps the bank
            maps.append(mmap.mmap(fd, n, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE))
        finally:
            os.close(fd)
        jobs += [(maps[-1], off, min(CHUNK, n - off)) for off in range(0, n, CHUNK)]
    _pool(jobs, threads, populate)     # the engine's call: ctypes, the GIL released
    return maps


SIDES = {"odirect": read_odirect, "mmap": read_mmap}


def spin_rate(stop: threading.Event) -> float:
    """Iterations a second of a pure-Python busy loop on this thread until ``stop``."""
    n, t0 = 0, time.perf_counter()
    while not stop.is_set():
        for _ in range(10000):
            n += 1
    return n / (time.perf_counter() - t0)


def one(side: str, files: list[Path], threads: int, probe: bool) -> dict:
    drop_caches()
    stop, res, rate = threading.Event(), {}, None
    c0, t0 = _cpu(), time.perf_counter()
    if probe:
        def reader():
            res["dest"] = SIDES[side](files, threads)
            stop.set()
        t = threading.Thread(target=reader)
        t.start()
        rate = spin_rate(stop)
        t.join()
    else:
        res["dest"] = SIDES[side](files, threads)
    secs, cpu = time.perf_counter() - t0, _cpu() - c0
    del res["dest"]
    nbytes = sum(f.stat().st_size for f in files)
    return {"side": side, "seconds": secs, "gbps": nbytes / secs / 1e9, "reader_cpu_seconds": sum(WORKER_CPU),
            "process_cpu_seconds": cpu, "probe_rate": rate}


def make_files(folder: Path, gib: int) -> None:
    import numpy as np
    folder.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng(0)
    for i in range(gib):
        with open(folder / f"part{i:03d}.bin", "wb") as f:
            for _ in range(16):
                f.write(gen.integers(0, 255, 64 << 20, dtype=np.uint8).tobytes())
    os.sync()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", type=Path, default=Path("/tmp/read_cpu_cost"))
    ap.add_argument("--make", type=int, default=0, help="write this many GiB of test files into --folder first")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probe", action="store_true", help="also run a busy loop on the main thread during each read")
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "read_cpu_cost.json")
    args = ap.parse_args()
    if args.make:
        make_files(args.folder, args.make)
    files = sorted(args.folder.glob("*.bin"))
    if not files:
        sys.exit(f"error: no *.bin files in {args.folder} (use --make N)")
    if not drop_caches():
        sys.exit("error: cannot drop the page cache (needs root): every read would be warm")
    alone = None
    if args.probe:
        stop = threading.Event()
        threading.Timer(1.0, stop.set).start()
        alone = spin_rate(stop)
    rows = [one(side, files, args.threads, args.probe) for _ in range(args.rounds) for side in SIDES]
    print(f"{'side':8} {'seconds':>8} {'GB/s':>6} {'reader CPU s':>13} {'process CPU s':>14} {'busy loop vs alone':>19}")
    for r in rows:
        r["probe_share"] = r["probe_rate"] / alone if alone else None
        share = f"{r['probe_share']:.2f}" if alone else "-"
        print(f"{r['side']:8} {r['seconds']:8.2f} {r['gbps']:6.2f} {r['reader_cpu_seconds']:13.2f} "
              f"{r['process_cpu_seconds']:14.2f} {share:>19}")
    keys = ("seconds", "gbps", "reader_cpu_seconds") + (("probe_share",) if alone else ())
    med = {s: {k: statistics.median(r[k] for r in rows if r["side"] == s) for k in keys} for s in SIDES}
    entry = {"hardware": describe(), "threads": args.threads, "rounds": args.rounds,
             "bytes": sum(f.stat().st_size for f in files), "probe_alone_rate": alone,
             "command": " ".join(["python", "bench/read_cpu_cost.py"] + sys.argv[1:]), "rows": rows, "medians": med,
             "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    data = json.loads(args.out.read_text()) if args.out.exists() else {"benchmark": "read_cpu_cost", "method": __doc__}
    data.setdefault("entries", {})[args.label] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    plot(data, args.out.with_suffix(".png"))
    print(f"wrote {args.out} (entry {args.label})")


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = list(data["entries"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, key, title in zip(axes, ("gbps", "reader_cpu_seconds"), ("read GB/s (median)", "reader threads' CPU seconds")):
        for j, side in enumerate(SIDES):
            ax.bar([i + 0.4 * (j - 0.5) for i in range(len(labels))],
                   [data["entries"][lab]["medians"][side][key] for lab in labels], 0.4, label=side)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle("a cold bank read: O_DIRECT into fresh memory vs a populated file mapping", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
