"""The packed reader beside Python work: does a restart's read slow down while the imports and
the graph capture hold the GIL, and do spans of several blocks per read (``early.SPAN``) help?

A restart reads the bank on ``early.Fill``'s threads while the main thread imports torch and
captures the decode graphs. Each reader needs the GIL between two reads; a main thread running
Python holds it and hands it over only every switch interval (5 ms). Sides, each from a dropped
page cache, alternating over ``--rounds`` in one process, on the same packed folder:

- ``disk``: ``disk_read.parallel_direct_read`` (16 MiB reads on ``--threads`` threads into
  reused buffers), the reference every restart figure is compared with;
- ``fill span=S, idle``: the engine's reader (8 threads, no CRC, as a restart), the main thread
  waiting for it;
- ``fill span=S, busy``: the same while the main thread runs pure Python until the read ends
  (the worst case of an import or a capture: it never releases the GIL on its own);
- with ``--mmap``: ``mmap alone``, the main thread mapping, touching and unmapping 4 MiB of
  anonymous memory in a loop for 3 s (what CUDA's set-up and torch's allocations do underneath);
  ``fill span=S, mmap``, the same loop beside the read, whose reads fault in the fresh pages
  they land on (the engine's reader); ``... prefaulted``, beside the same read into arenas
  whose pages were faulted in before the clock started (``MADV_POPULATE_WRITE``), and ``...
  faulted in first``, the faulting timed too, on the reader's 8 threads before they read. The
  loop's rate says whether the read's page faults hold the main thread's mappings up (the
  process's page-table lock).

    python bench/read_contention.py --folder PACKED_FOLDER --label NAME
    python bench/read_contention.py --layers 6 --dir /tmp/rc --label NAME   # writes a synthetic folder first

Writes bench/results/read_contention.json (+ read_contention_LABEL.png): seconds and GB/s per side and round, and the
median of each side against the same round's disk read.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from disk_read import drop_caches, parallel_direct_read  # noqa: E402
from hardware import describe  # noqa: E402

from freetoken_engine.packed import early  # noqa: E402
from freetoken_engine.packed.format import read_index  # noqa: E402

READERS = 8        # the loader's and preload's default


def busy_until(done: threading.Event) -> int:
    """Pure Python on this thread until ``done``; -> loop turns (how much Python ran)."""
    turns = 0
    while not done.is_set():
        sum(i * i for i in range(2000))
        turns += 1
    return turns


def mmap_until(done: threading.Event) -> int:
    """Map, touch and unmap 4 MiB on this thread until ``done``; -> loop turns."""
    import mmap
    turns = 0
    while not done.is_set():
        m = mmap.mmap(-1, 4 << 20)
        for at in range(0, 4 << 20, 1 << 20):
            m[at] = 1
        m.close()
        turns += 1
    return turns


def mmap_alone(seconds: float) -> dict:
    done = threading.Event()
    threading.Timer(seconds, done.set).start()
    t0 = time.perf_counter()
    turns = mmap_until(done)
    secs = time.perf_counter() - t0
    return {"seconds": secs, "gbps": 0.0, "python_turns": turns, "turns_per_second": turns / secs}


def fault_in(arenas, threads: int) -> None:
    """Fault every page of ``arenas`` in (``MADV_POPULATE_WRITE``, Linux 5.14+) on ``threads``
    threads, 16 MiB per call (ctypes releases the GIL)."""
    import ctypes
    from concurrent.futures import ThreadPoolExecutor
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    views = [ctypes.c_char.from_buffer(mm) for mm in arenas]
    pieces = [(ctypes.addressof(v) + at, min(16 << 20, len(mm) - at))
              for v, mm in zip(views, arenas) for at in range(0, len(mm), 16 << 20)]
    with ThreadPoolExecutor(threads) as pool:
        failed = [rc for rc in pool.map(lambda p: libc.madvise(p[0], p[1], 23), pieces) if rc]
    del views
    if failed:
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) failed (Linux 5.14+ needed)")


def fill_read(folder: Path, span: int, busy: bool | str, fault: str | None = None, huge: bool = True) -> dict:
    """``fault``: None (the reads fault their pages), "before" (untimed) or "first" (timed).
    ``huge``: the arenas on transparent huge pages (the engine's default) or on 4 KiB pages."""
    index = read_index(folder)
    os.environ["FREETOKEN_HUGE_PAGES"] = "on" if huge else "off"      # read by packed.memory.arena
    fill = early.Fill(folder, index, False, True, READERS, span=span)
    if fault == "before":
        fault_in(list(fill.arenas.values()), READERS)
    done, turns = threading.Event(), 0

    def read():
        if fault == "first":
            fault_in(list(fill.arenas.values()), READERS)
        fill.start().wait()
        done.set()
    waiter = threading.Thread(target=read)
    t0 = time.perf_counter()
    waiter.start()
    if busy:
        turns = (mmap_until if busy == "mmap" else busy_until)(done)
    waiter.join()
    secs = time.perf_counter() - t0
    nbytes = fill.total
    fill = None                 # its arenas are unmapped before the next side reads
    gc.collect()
    return {"seconds": secs, "gbps": nbytes / secs / 1e9, "python_turns": turns, "turns_per_second": turns / secs}


def disk_read(folder: Path, threads: int) -> dict:
    files = sorted(folder.glob("*.bin"))
    t0 = time.perf_counter()
    parallel_direct_read(files, threads)
    secs = time.perf_counter() - t0
    return {"seconds": secs, "gbps": sum(f.stat().st_size for f in files) / secs / 1e9}


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    sides = list(result["median_seconds"])
    rates = result.get("median_turns_per_second", {})
    busy = [x for x in sides if rates.get(x)]
    fig, axes = plt.subplots(1, 2 if busy else 1, figsize=(13 if busy else 8, 4.5), squeeze=False)
    ax = axes[0][0]
    ax.barh(sides, [result["median_seconds"][x] for x in sides], color="tab:blue")
    ax.set_xlabel("seconds to read the folder (median of rounds)")
    ax.set_title(f"packed read beside main-thread work: {result['hardware'].get('cpu', '')}", fontsize=9)
    if busy:
        ax = axes[0][1]
        ax.barh(busy, [rates[x] for x in busy], color="tab:orange")
        ax.set_xlabel("main thread's loops per second (median)")
        ax.set_title("how much the main thread got done meanwhile", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", type=Path, help="a packed folder (else one is written to --dir)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ft-read-contention"))
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=16, help="threads of the disk reference")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spans", default=f"1,{early.SPAN}")
    ap.add_argument("--mmap", action="store_true", help="also the sides with a main thread that maps memory")
    ap.add_argument("--pages", default="huge", help="huge,4k: the reader's sides on both kinds of pages")
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/read_contention.json")
    args = ap.parse_args()
    folder = args.folder
    if folder is None:
        from fast_load import write_checkpoint
        from freetoken_engine.packed import convert
        shutil.rmtree(args.dir, ignore_errors=True)
        write_checkpoint(args.dir / "st", args.layers)
        convert(args.dir / "st", args.dir / "packed", progress=False)
        shutil.rmtree(args.dir / "st")
        folder = args.dir / "packed"
    sides = {"disk": lambda: disk_read(folder, args.threads)}
    if args.mmap:
        sides["mmap alone"] = lambda: mmap_alone(3.0)
    for pages in args.pages.split(","):
        huge, tag = pages == "huge", "" if pages == "huge" else f", {pages} pages"
        for span in (int(s) for s in args.spans.split(",")):
            for busy in (False, True) + (("mmap",) if args.mmap else ()):
                kind = {False: "idle", True: "busy"}.get(busy, busy)
                sides[f"fill span={span}, {kind}{tag}"] = \
                    (lambda span=span, busy=busy, huge=huge: fill_read(folder, span, busy, huge=huge))
            for fault, what in ((("before", "prefaulted"), ("first", "faulted in first")) if args.mmap else ()):
                sides[f"fill span={span}, mmap, {what}{tag}"] = \
                    (lambda span=span, fault=fault, huge=huge: fill_read(folder, span, "mmap", fault, huge))
    runs = []
    for r in range(args.rounds):
        for name, fn in sides.items():
            dropped = drop_caches()
            runs.append({"round": r, "side": name, "page_cache_dropped": dropped, **fn()})
            x = runs[-1]
            print(f"round {r} {name:<44} {x['seconds']:6.2f} s {x['gbps']:6.2f} GB/s "
                  f"{x.get('turns_per_second', 0):8.0f} main-thread loops/s", flush=True)
    med = {name: statistics.median(x["seconds"] for x in runs if x["side"] == name) for name in sides}
    result = {"benchmark": "read_contention", "label": args.label, "hardware": describe(),
              "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "method": __doc__,
              "folder_bytes": sum(f.stat().st_size for f in folder.glob("*.bin")), "readers": READERS,
              "runs": runs, "median_seconds": med,
              "median_over_disk": {name: med[name] / med["disk"] for name in sides}}
    rate = {name: statistics.median(x.get("turns_per_second", 0) for x in runs if x["side"] == name) for name in sides}
    result["median_turns_per_second"] = rate
    print(f"\n{'side':<46}{'median s':>10}{'x disk':>9}{'main loop/s':>13}")
    for name in sides:
        print(f"{name:<46}{med[name]:>10.2f}{result['median_over_disk'][name]:>9.2f}{rate[name]:>13.0f}")
    data = json.loads(args.out.read_text()) if args.out.exists() else {"benchmark": "read_contention", "machines": {}}
    data["machines"][args.label] = result
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    plot(result, args.out.with_name(f"{args.out.stem}_{args.label}.png"))
    if args.folder is None:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
