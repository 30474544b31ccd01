"""What the decode graphs cost in device memory and capture time, per graph, in a deep model.

A server keeps one CUDA graph per (batch size, KV width) it decodes at. This captures every
batch size 1..``--max-batch`` at the narrowest ``--widths`` KV widths, one width at a time,
through the engine's own ahead-of-time path (``ModelRunner.warm_graphs``), and reads after each
width: the device's free memory (``cudaMemGetInfo``: the graphs' executable images and the
allocator's pools together), the allocator's reserved and allocated bytes, and the seconds the
captures took (each key: one eager step, the capture, one replay); and each graph's own
measurement (``capture_mb``: free memory lost across its capture and its first replay, which
the engine's ``held_bytes`` adds up for the metric ``freetoken_decode_graph_bytes``). The first
width's free-memory figure also sees whatever the engine's start left to settle (its first
eager steps, freed start-up buffers); later widths do not. The graphs write one shared
logits buffer (executor/graphs.py); ``own_logits_mb`` is what the same graphs held before, each
its own ``[B, V]`` float32 logits.

``--limit-gb G``: the engine's limit on the graphs' memory (``--graph-memory-gb``; 0, the
default here, for none). Each key is then captured as serving captures it (its eager step, the
capture, one replay, through ``ModelRunner.forward``), since the warm-up never drops a graph, and
with ``DecodeGraphs.KEEP_STEPS = 0``, so every older key counts as gone quiet: past the limit each
capture replaces the graph replayed least recently. Run each side in its own process: the driver
keeps a dropped graph's memory for the process's later graphs.

Checkpoint: ``engine_gpu_decode.py``'s (random bf16 weights in Qwen3-30B-A3B's shapes,
``--layers`` layers, ``--stretch`` for a RAM-backed repeated one), expert cache at ``--fraction``
of the experts.

    python bench/graph_memory.py --layers 48 --stretch /dev/shm   # on the GPU machine
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from hardware import describe  # noqa: E402

MB = 1e6


def measure(model: Path, fraction: float, max_batch: int, widths: int, limit_gb: float) -> dict:
    import torch

    from freetoken_engine import LLM
    from freetoken_engine.executor.graphs import DecodeGraphs
    cfg = json.loads((model / "config.json").read_text())
    experts = max(1, round(fraction * cfg["num_hidden_layers"] * cfg["num_experts"]))
    llm = LLM(model, device="cuda", dtype="bfloat16", expert_cache_experts=experts, graph_warmup=0,
              max_batch=max_batch, graph_memory_gb=limit_gb)
    runner, vocab = llm.runner, cfg["vocab_size"]
    DecodeGraphs.KEEP_STEPS = 0

    def serve(w: int) -> int:
        """Batch sizes 1..max_batch at the w-th width, captured as serving captures them."""
        width, n = runner.graphs.widths()[w - 1], 0
        scratch = runner.kv.allocate(1)
        for b in range(1, max_batch + 1):
            chunks = runner.dummy_decode(scratch, width, b)
            runner.forward(chunks)
            n += (b, width) in runner.graphs
            runner.forward(chunks)
        runner.kv.release(scratch)
        return n

    def state() -> dict:
        torch.cuda.synchronize()
        return {"free": torch.cuda.mem_get_info()[0], "reserved": torch.cuda.memory_reserved(),
                "allocated": torch.cuda.memory_allocated()}

    rows, before = [], state()
    for w in range(1, widths + 1):
        t0 = time.perf_counter()
        n = serve(w) if limit_gb else runner.warm_graphs(max_batch, widths=w)
        secs = time.perf_counter() - t0
        after = state()
        rows.append({"width": runner.graphs.widths()[w - 1], "graphs": n, "seconds": secs,
                     "seconds_per_graph": secs / max(n, 1),
                     "device_mb": (before["free"] - after["free"]) / MB,
                     "reserved_mb": (after["reserved"] - before["reserved"]) / MB,
                     "allocated_mb": (after["allocated"] - before["allocated"]) / MB,
                     "own_logits_mb": sum(range(1, max_batch + 1)) * vocab * 4 / MB})
        width = rows[-1]["width"]
        each = sorted(g.bytes / MB for (b, w), g in runner.graphs._graphs.items() if w == width)
        rows[-1].update({"device_mb_per_graph": rows[-1]["device_mb"] / max(n, 1),
                         "capture_mb": each, "capture_mb_median": statistics.median(each) if each else 0,
                         "graphs_held": len(runner.graphs), "dropped": runner.graphs.dropped,
                         "held_mb": runner.graphs.held_bytes / MB})
        before = after
    return {"layers": cfg["num_hidden_layers"], "vocab": vocab, "cache_experts": experts,
            "max_batch": max_batch, "limit_gb": limit_gb, "rows": rows, "graphs_total": len(runner.graphs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--widths", type=int, default=2, help="the narrowest N KV widths")
    ap.add_argument("--limit-gb", type=float, default=0.0, help="--graph-memory-gb (0: no limit)")
    ap.add_argument("--stretch", type=Path, default=None, metavar="FAST_DIR")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/graph_memory.json")
    args = ap.parse_args()
    from stretch import bench_checkpoint
    work = Path(tempfile.mkdtemp(dir=args.stretch))
    try:
        model, _ = bench_checkpoint(work, args.layers, work if args.stretch else None)
        res = measure(model, args.fraction, args.max_batch, args.widths, args.limit_gb)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'width':>6} {'graphs':>6} {'s/graph':>8} {'device MB':>9} {'MB/graph':>8} {'capture MB':>10} "
          f"{'reserved MB':>11} {'allocated MB':>12} {'own logits MB':>13} {'held':>5} {'dropped':>7}")
    for r in res["rows"]:
        print(f"{r['width']:6d} {r['graphs']:6d} {r['seconds_per_graph']:8.3f} {r['device_mb']:9.1f} "
              f"{r['device_mb_per_graph']:8.2f} {r['capture_mb_median']:10.2f} {r['reserved_mb']:11.1f} "
              f"{r['allocated_mb']:12.1f} {r['own_logits_mb']:13.1f} {r['graphs_held']:5d} {r['dropped']:7d}")
    result = {"benchmark": "graph_memory", "hardware": describe(), "method": __doc__,
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", "bench/graph_memory.py"] + sys.argv[1:]), **res}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["device_mb"] for r in rows], 0.4, label="device memory the graphs took")
    ax.bar([i + 0.2 for i in x], [r["own_logits_mb"] for r in rows], 0.4, label="their own logits (before)")
    ax.set_xticks(list(x), [f"width {r['width']}\n{r['graphs']} graphs" for r in rows])
    ax.set_ylabel("MB")
    ax.set_title(f"decode graphs of batch sizes 1..{result['max_batch']}, {result['layers']} layers, vocab {result['vocab']}\n"
                 f"{result['hardware'].get('gpu', '?')}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
