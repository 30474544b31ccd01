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
  (the worst case of an import or a capture: it never releases the GIL on its own).

    python bench/read_contention.py --folder PACKED_FOLDER --label NAME
    python bench/read_contention.py --layers 6 --dir /tmp/rc --label NAME   # writes a synthetic folder first

Writes bench/results/read_contention.json (+ .png): seconds and GB/s per side and round, and the
median of each side against the same round's disk read.
"""
from __future__ import annotations

import argparse
import gc
import json
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


def fill_read(folder: Path, span: int, busy: bool) -> dict:
    index = read_index(folder)
    fill = early.Fill(folder, index, False, True, READERS, span=span).start()
    done, turns = threading.Event(), 0
    waiter = threading.Thread(target=lambda: (fill.wait(), done.set()))
    t0 = time.perf_counter()
    waiter.start()
    if busy:
        turns = busy_until(done)
    waiter.join()
    secs = time.perf_counter() - t0
    nbytes = fill.total
    fill = None                 # its arenas are unmapped before the next side reads
    gc.collect()
    return {"seconds": secs, "gbps": nbytes / secs / 1e9, "python_turns": turns}


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
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(sides, [result["median_seconds"][s] for s in sides], color="tab:blue")
    ax.set_xlabel("seconds to read the folder (median of rounds)")
    ax.set_title(f"packed read beside Python work: {result['hardware'].get('cpu', '')}", fontsize=9)
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
    for span in (int(s) for s in args.spans.split(",")):
        for busy in (False, True):
            sides[f"fill span={span}, {'busy' if busy else 'idle'}"] = \
                (lambda span=span, busy=busy: fill_read(folder, span, busy))
    runs = []
    for r in range(args.rounds):
        for name, fn in sides.items():
            dropped = drop_caches()
            runs.append({"round": r, "side": name, "page_cache_dropped": dropped, **fn()})
            x = runs[-1]
            print(f"round {r} {name:<24} {x['seconds']:6.2f} s {x['gbps']:6.2f} GB/s", flush=True)
    med = {name: statistics.median(x["seconds"] for x in runs if x["side"] == name) for name in sides}
    result = {"benchmark": "read_contention", "label": args.label, "hardware": describe(),
              "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "method": __doc__,
              "folder_bytes": sum(f.stat().st_size for f in folder.glob("*.bin")), "readers": READERS,
              "runs": runs, "median_seconds": med,
              "median_over_disk": {name: med[name] / med["disk"] for name in sides}}
    print(f"\n{'side':<26}{'median s':>10}{'x disk':>9}")
    for name in sides:
        print(f"{name:<26}{med[name]:>10.2f}{result['median_over_disk'][name]:>9.2f}")
    data = json.loads(args.out.read_text()) if args.out.exists() else {"benchmark": "read_contention", "machines": {}}
    data["machines"][args.label] = result
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    if args.folder is None:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
