"""What the bank's read does to every other read from the same disk during a restart.

While a restart reads its bank, the main thread runs code it has not run before in this
process: torch's CPU and CUDA kernels, cuBLAS, Triton's compiler. Their pages come from the
libraries' files, and where the page cache does not hold them (the +warm restarts of
``fast_load.py`` only imported the libraries), each first touch is a read queued behind the
bank's. A stack sample of device run 77's restarts (``restart_probe.py /stacks``) put 0.4-0.75 s
into the first tiny CPU op (the rope table) and 0.1-0.4 s into each of the first CUDA op, cuBLAS
call and Triton compile, all while the bank was read.

Sides, each from a dropped page cache, alternating over ``--rounds``: the main thread touches one
byte of a 4 KiB page of a cold "library" file (``--library-gb`` of random bytes, mapped
read-only like a shared library; pages twice the read-ahead apart in random order, each touched
once: a fault reads the read-ahead around its page, as a library's does) for ``--seconds`` alone, and
beside the engine's reader (``early.Fill``: a restart's, no CRC) in each configuration of
``--configs`` (READERS x SPAN blocks of 16 MiB per read; the engine's default is 8 x 4). Reported:
the touches' latency (median, p90, max) and the bank read's GB/s, plus the disk's queue settings.

    python bench/read_latency.py --folder PACKED_FOLDER --label NAME [--configs 8x4,4x4,2x4,8x1]

Writes bench/results/read_latency.json (+ read_latency_LABEL.png).
"""
from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import random
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from disk_read import drop_caches  # noqa: E402
from hardware import describe  # noqa: E402

from freetoken_engine.packed import early  # noqa: E402
from freetoken_engine.packed.format import read_index  # noqa: E402

PAGE = 4096


def queue_settings(path: Path) -> dict:
    """The block device under ``path``: its scheduler and queue limits (sysfs), where readable."""
    st = os.stat(path)
    base = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    try:
        dev = base.resolve()
        queue = dev / "queue" if (dev / "queue").exists() else dev.parent / "queue"
        out = {"device": dev.name}
        for k in ("scheduler", "nr_requests", "max_sectors_kb", "read_ahead_kb", "rotational", "nr_hw_queues"):
            p = queue / k
            if p.exists():
                out[k] = p.read_text().strip()
        mq = dev / "mq" if (dev / "mq").exists() else dev.parent / "mq"
        if mq.exists():
            out["hw_queues"] = len(list(mq.iterdir()))
        return out
    except OSError as exc:
        return {"error": str(exc)}


def write_library(path: Path, gb: float) -> None:
    if path.exists() and path.stat().st_size >= gb * 1e9:
        return
    chunk = os.urandom(64 << 20)
    with open(path, "wb") as f:
        for _ in range(max(1, int(gb * 1e9) // len(chunk))):
            f.write(chunk)


def stride(path: Path) -> int:
    """Twice the device's read-ahead (a fault reads that much around the page), at least 1 MiB."""
    try:
        return max(1 << 20, 2 * 1024 * int(queue_settings(path).get("read_ahead_kb", 0)))
    except ValueError:
        return 1 << 20


def touch_until(lib: Path, done: threading.Event, seconds: float) -> list[float]:
    """Latency (s) of the first touch of pages of ``lib`` in random order, each ``stride`` apart
    (so no touch finds an earlier one's read-around), until ``done`` or ``seconds``."""
    with open(lib, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    order = list(range(0, len(mm) - PAGE, stride(lib)))
    random.Random(0).shuffle(order)
    lat, t_end = [], time.perf_counter() + seconds
    for at in order:
        if done.is_set() or time.perf_counter() >= t_end:
            break
        t = time.perf_counter()
        mm[at]
        lat.append(time.perf_counter() - t)
    mm.close()
    return lat


def side(folder: Path | None, lib: Path, readers: int, span: int, seconds: float) -> dict:
    drop_caches()
    done = threading.Event()
    res: dict = {}
    fill = None
    if folder is not None:
        fill = early.Fill(folder, read_index(folder), False, True, readers, span=span)

        def read():
            t0 = time.perf_counter()
            fill.start().wait()
            res["read_seconds"] = time.perf_counter() - t0
            res["read_gbps"] = fill.total / res["read_seconds"] / 1e9
            done.set()
        waiter = threading.Thread(target=read)
        waiter.start()
        time.sleep(0.3)                 # the reader's queue is full before the first touch
    lat = touch_until(lib, done, seconds)
    if fill is not None:
        waiter.join()
        fill = None
        gc.collect()
    lat.sort()
    ms = [x * 1e3 for x in lat]
    res.update(touches=len(ms), median_ms=statistics.median(ms) if ms else None,
               p90_ms=ms[int(0.9 * (len(ms) - 1))] if ms else None, max_ms=ms[-1] if ms else None)
    return res


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(result["median"])
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [result["median"][n]["median_ms"] for n in names], 0.4, label="median")
    ax.bar([x + 0.2 for x in xs], [result["median"][n]["p90_ms"] for n in names], 0.4, label="p90")
    ticks = [n.replace(" readers x ", "x").replace(" blocks", "")
             + (f"\nbank {result['median'][n]['read_gbps']:.2f} GB/s" if "read_gbps" in result["median"][n] else "")
             for n in names]
    ax.set_xticks(list(xs), ticks, fontsize=8)
    ax.set_xlabel("readers x blocks of 16 MiB per read")
    ax.set_ylabel("first touch of a cold page (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{result['label']}: page-in latency beside the bank's read", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", type=Path, required=True, help="a packed folder")
    ap.add_argument("--library", type=Path, help="the cold file (default: written beside the folder)")
    ap.add_argument("--library-gb", type=float, default=2.0)
    ap.add_argument("--configs", default="8x4,8x1,4x4,2x4,2x1")
    ap.add_argument("--seconds", type=float, default=3.0, help="touching alone")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/read_latency.json")
    args = ap.parse_args()
    lib = args.library or args.folder.parent / "cold-library.bin"
    write_library(lib, args.library_gb)
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    names = ["alone"] + [f"{r} readers x {s} blocks" for r, s in configs]
    rounds = []
    for k in range(args.rounds):
        row = {"alone": side(None, lib, 0, 0, args.seconds)}
        for (r, s), name in zip(configs, names[1:]):
            row[name] = side(args.folder, lib, r, s, 60.0)
        rounds.append(row)
        for name, v in row.items():
            print(f"round {k + 1} {name:>22}: touches {v['touches']:5d}, median {v['median_ms']:.2f} ms, p90 "
                  f"{v['p90_ms']:.2f} ms, max {v['max_ms']:.1f} ms"
                  + (f"; bank read {v['read_seconds']:.2f} s ({v['read_gbps']:.2f} GB/s)" if "read_seconds" in v else ""))
    med = {n: {k: statistics.median(r[n][k] for r in rounds) for k in rounds[0][n] if rounds[0][n][k] is not None}
           for n in names}
    print(f"\n{'side':>24} | median ms | p90 ms | bank GB/s")
    for n in names:
        print(f"{n:>24} | {med[n]['median_ms']:9.2f} | {med[n]['p90_ms']:6.2f} | {med[n].get('read_gbps', float('nan')):.2f}")
    result = {"label": args.label, "hardware": describe(), "measured_at": datetime.now(timezone.utc).isoformat(),
              "folder_bytes": sum(f.stat().st_size for f in args.folder.glob("*.bin")),
              "queue": queue_settings(args.folder), "configs": args.configs, "rounds": rounds, "median": med,
              "command": " ".join(sys.argv)}
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data[args.label] = result
    args.out.write_text(json.dumps(data, indent=1))
    plot(result, args.out.with_name(f"read_latency_{args.label}.png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
