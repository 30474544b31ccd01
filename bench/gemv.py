"""A decode step's dense projections on the GPU: the Triton GEMV (kernels/triton/gemv.py) against
torch's ``F.linear`` (cuBLAS), same process, same weights.

Shapes: the projections a decode step runs besides the experts, for Qwen3-30B-A3B (fused q/k/v
2048 -> 5120, output 4096 -> 2048, the LM head 2048 -> 151936) and Qwen3.6-35B-A3B's layers as
the engine bench builds them (q/k/v 2048 -> 2560, output 2048 -> 2048, the shared expert's
gate/up 2048 -> 1024 and down 512 -> 2048), at 1, 2 and 4 tokens (the decode graphs' batches).

Each case is timed as the engine runs it: inside one CUDA graph of ``--calls`` calls, cycling
over enough copies of the weights (at least 4x the GPU's L2) that every call reads its weights
from HBM, as a layer's do in a decode step. us per call = replay time / calls (median of
``--rounds`` replays); GB/s = weight bytes / that time. ``--sweep`` also times a grid of both
kernels' configurations (``configs``) on four of the shapes, to choose the defaults: per batch,
each configuration's geometric mean over those shapes of its time / the shape's best.
Writes JSON + PNG (hardware named) and prints a table.

    python bench/gemv.py [--sweep] [--out bench/results/gemv_gpu.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "engine"))
from hardware import describe  # noqa: E402

SHAPES = {  # name -> (K, N)
    "qwen3-30b q/k/v": (2048, 5120), "qwen3-30b o": (4096, 2048), "qwen3-30b lm_head": (2048, 151936),
    "qwen3.6 q/k/v": (2048, 2560), "qwen3.6 o": (2048, 2048), "qwen3.6 shared gate/up": (2048, 1024),
    "qwen3.6 shared down": (512, 2048),
}
SWEEP_SHAPES = ("qwen3-30b q/k/v", "qwen3-30b o", "qwen3.6 q/k/v", "qwen3.6 shared gate/up")


def timed(fn, weights: list, x: torch.Tensor, calls: int, rounds: int) -> float:
    """us per call of fn(x, w) cycling over ``weights``, replayed from one CUDA graph."""
    return graph_us(fn, [(x, weights[i % len(weights)]) for i in range(calls)], rounds, warm=2)


def graph_us(fn, calls: list, rounds: int, warm: int | None = None) -> float:
    """us per call of ``fn(*a)`` for each argument tuple ``a`` of ``calls``, captured in one CUDA
    graph: the median of ``rounds`` replays. The first ``warm`` calls (all by default) run first
    on a side stream, outside the capture (compiling, picking kernels, filling allocator pools)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for a in calls[:warm]:
            fn(*a)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in calls:
            fn(*a)
    graph.replay()
    torch.cuda.synchronize()
    return replay_us(graph, len(calls), rounds)


def replay_us(graph: torch.cuda.CUDAGraph, calls: int, rounds: int) -> float:
    """us per call of ``graph`` holding ``calls`` calls: the median of ``rounds`` timed replays."""
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench/results/gemv_gpu.json"))
    args = ap.parse_args()
    from freetoken_engine.kernels.triton import gemv
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows, sweep = [], []
    for name, (k, n) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-4 * l2 // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        for m in [int(b) for b in args.batches.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, weights[0]).float()
            err = (gemv.linear(x, weights[0]).float() - ref).abs().max().item()
            t_torch = timed(F.linear, weights, x, args.calls, args.rounds)
            t_ours = timed(gemv.linear, weights, x, args.calls, args.rounds)
            row = {"shape": name, "K": k, "N": n, "tokens": m, "weight_bytes": nbytes, "copies": copies,
                   "config": list(gemv.default_config(m, k, n)), "torch_us": t_torch, "triton_us": t_ours,
                   "torch_gbps": nbytes / t_torch / 1e3, "triton_gbps": nbytes / t_ours / 1e3,
                   "speedup": t_torch / t_ours, "max_abs_diff_vs_torch": err, "max_abs_torch": ref.abs().max().item()}
            rows.append(row)
            print(f"{name:24} m={m} torch {t_torch:7.2f} us ({row['torch_gbps']:6.0f} GB/s)  triton {t_ours:7.2f} us "
                  f"({row['triton_gbps']:6.0f} GB/s)  {row['speedup']:.2f}x  diff {err:.2e}", flush=True)
            if args.sweep and name in SWEEP_SHAPES:
                sweep += _sweep(gemv, name, weights, x, args, nbytes)
        del weights
        torch.cuda.empty_cache()
    result = {"benchmark": "gemv_gpu", "hardware": describe(), "method": __doc__,
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", "bench/gemv.py"] + sys.argv[1:]), "rows": rows, "sweep": sweep,
              "sweep_summary": summary(sweep, rows) if sweep else {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out}")


def configs(m: int) -> list[tuple]:
    """The sweep's grid: the lanes kernel's (BLOCK_N, BLOCK_K, warps) whose accumulators stay at
    <= 8192 values, and the tensor-core kernel's (BLOCK_N, BLOCK_K, warps, stages)."""
    from freetoken_engine.kernels.triton.gemv import next_pow2
    lanes = [("lanes", bn, bk, w) for bk in (512, 1024, 2048) for bn in (1, 2, 4, 8) for w in (2, 4)
             if next_pow2(m) * bn * bk <= 8192]
    mma = [("mma", bn, bk, w, st) for bn in (16, 32, 64) for bk in (64, 128, 256, 512) for w in (2, 4)
           for st in (2, 3, 4) if (bn + 16) * bk * 2 * st <= 160 * 1024]      # the stages' tiles in shared memory
    return lanes + mma


def _sweep(gemv, name: str, weights: list, x: torch.Tensor, args, nbytes: int) -> list[dict]:
    """Every configuration of ``configs`` on this shape and batch."""
    m, k = x.shape
    out = []
    for cfg in configs(m):
        if cfg[2] > k:
            continue
        def fn(x, w, cfg=cfg):
            return gemv.linear(x, w, config=cfg)
        t = timed(fn, weights, x, args.calls, args.rounds)
        out.append({"shape": name, "tokens": m, "config": list(cfg), "us": t, "gbps": nbytes / t / 1e3})
    for kind in ("lanes", "mma"):
        best = min((r for r in out if r["config"][0] == kind), key=lambda r: r["us"])
        print(f"  sweep {name} m={m}: best {kind} {best['config'][1:]} {best['us']:.2f} us ({best['gbps']:.0f} GB/s)",
              flush=True)
    return out


def summary(sweep: list[dict], rows: list[dict]) -> dict:
    """Per batch: the configurations by their geometric mean over the swept shapes of time / the
    shape's best time (1.0 = the best everywhere), the five best, and cuBLAS on the same scale."""
    import math
    out = {}
    for m in sorted({r["tokens"] for r in sweep}):
        mine = [r for r in sweep if r["tokens"] == m]
        shapes = sorted({r["shape"] for r in mine})
        best = {s: min(r["us"] for r in mine if r["shape"] == s) for s in shapes}
        by = {}
        for r in mine:
            by.setdefault(tuple(r["config"]), {})[r["shape"]] = r["us"]
        score = {c: math.exp(sum(math.log(v[s] / best[s]) for s in shapes) / len(shapes))
                 for c, v in by.items() if len(v) == len(shapes)}
        torch_us = {r["shape"]: r["torch_us"] for r in rows if r["tokens"] == m and r["shape"] in best}
        out[f"m={m}"] = {"top": [[list(c), round(g, 3)] for c, g in sorted(score.items(), key=lambda kv: kv[1])[:5]],
                         "cublas": round(math.exp(sum(math.log(torch_us[s] / best[s]) for s in shapes) / len(shapes)), 3)
                         if len(torch_us) == len(shapes) else None}
        print(f"m={m}: {out[f'm={m}']}", flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [f"{r['shape']}\nm={r['tokens']}" for r in rows]
    xs = range(len(rows))
    ax.bar([i - 0.2 for i in xs], [r["torch_gbps"] for r in rows], 0.4, label="F.linear (cuBLAS)")
    ax.bar([i + 0.2 for i in xs], [r["triton_gbps"] for r in rows], 0.4, label="Triton GEMV")
    ax.set_xticks(list(xs), labels, fontsize=6, rotation=90)
    ax.set_ylabel("weight GB/s (one CUDA graph of calls)")
    ax.set_title(f"decode projections, bf16: {result['hardware'].get('gpu', '?')}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
