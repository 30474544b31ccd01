"""Where a whole-engine decode step's time goes on the GPU: kernel time against step time.

Loads ``--layers`` layers of Qwen3-30B-A3B's shapes (``bench/stretch.py``: a 2-layer packed
checkpoint repeated, in a RAM-backed folder), caches ``--fraction`` of the experts, decodes
``--batch`` prompts of 32 tokens in lockstep (24 warm-up steps), then profiles ``--steps`` steps
with ``torch.profiler`` (CUDA graph replays are traced per kernel). Reports the step's wall time,
the GPU's busy time per step (the union of its kernels' intervals, copies included), and the
kernels by total time per step; the gap between the two is time in which no kernel ran: the
device waiting on the host (the CPU branch's answers, flags in pinned memory) or on launches.

    python bench/engine_profile.py --layers 48 --fraction 0.552 --stretch /dev/shm --out DIR
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from hardware import describe  # noqa: E402


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (us)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--fraction", type=float, default=0.552)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--stretch", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args()
    from stretch import bench_checkpoint

    from freetoken_engine import LLM
    from freetoken_engine.llm import Lockstep
    work = Path(tempfile.mkdtemp(dir=args.stretch))
    try:
        model, _ = bench_checkpoint(work, args.layers, work)
        cfg = json.loads((model / "config.json").read_text())
        experts = round(args.fraction * cfg["num_hidden_layers"] * cfg["num_experts"])
        llm = LLM(model, device="cuda", dtype="bfloat16", expert_cache_experts=experts, graph_warmup=0)
        batch = Lockstep(llm, [[(37 * i + 11 * t) % 31000 + 100 for t in range(32)] for i in range(args.batch)])
        for _ in range(24):
            batch.step()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                batch.step()
            wall = (time.perf_counter() - t0) / args.steps * 1e6
        stats = llm.runner.expert_stats()
        batch.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    kernels, intervals = defaultdict(lambda: [0.0, 0]), []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            start, dur = ev.time_range.start, ev.time_range.elapsed_us()
            intervals.append((start, start + dur))
            kernels[ev.name][0] += dur / args.steps
            kernels[ev.name][1] += 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:30]
    gpu = busy_us(intervals) / args.steps
    print(f"{args.layers} layers, cache {args.fraction:g}, batch {args.batch}: step {wall:.0f} us wall, "
          f"GPU busy {gpu:.0f} us ({gpu / wall:.0%}), {len(intervals) / args.steps:.0f} device ops per step")
    print(f"{'us/step':>9} {'calls/step':>10}  kernel")
    for name, (us, n) in top:
        print(f"{us:9.1f} {n / args.steps:10.1f}  {name[:110]}")
    result = {"benchmark": "engine_profile", "hardware": describe(), "method": __doc__,
              "command": " ".join(["python", "bench/engine_profile.py"] + sys.argv[1:]),
              "layers": args.layers, "cache_fraction": args.fraction, "batch": args.batch, "steps": args.steps,
              "step_us_wall": wall, "gpu_busy_us_per_step": gpu, "device_ops_per_step": len(intervals) / args.steps,
              "expert_stats": {k: v for k, v in stats.items() if k != "split_tuner"},
              "kernels_us_per_step": {name: {"us": us, "calls_per_step": n / args.steps} for name, (us, n) in top}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"engine_profile_{args.layers}L_b{args.batch}.json"
    path.write_text(json.dumps(result, indent=1))
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path}")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    items = list(result["kernels_us_per_step"].items())[:15][::-1]
    fig, ax = plt.subplots(figsize=(10, 6))
    ax.barh([n[:60] for n, _ in items], [v["us"] for _, v in items])
    ax.set_xlabel("us per decode step (sum over the step's calls)")
    ax.set_title(f"{result['layers']} layers, cache {result['cache_fraction']:g}, batch {result['batch']}: step "
                 f"{result['step_us_wall']:.0f} us, GPU busy {result['gpu_busy_us_per_step']:.0f} us\n"
                 f"{result['hardware'].get('gpu', '?')}", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
