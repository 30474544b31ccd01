"""A biased MoE router's choice on the GPU: the one-launch Triton kernel
(``kernels/triton/route.route_biased``) against the torch ops it replaces
(``layers/moe.biased_route``: a dozen launches), same process, same logits.

Routings: GLM-4.5-Air (128 experts, top 8), GLM-4.5 (160, scale 2.5), DeepSeek-V3's groups (256
in 8 groups, the best 4 kept) and ERNIE-4.5-21B-A3B (softmax scores, 64 experts, top 6), at 1 and
4 tokens (decode batches). Each side is timed as decode runs it: ``--calls`` routes captured in
one CUDA graph (as many as a model's MoE layers), us per route = replay time / calls, the median
of ``--rounds`` replays, the two sides alternating. The per-token figure is that times the
model's MoE layers. Writes JSON + PNG (hardware named) and prints a table.

    python bench/route_biased.py [--out bench/results/route_biased_h200.json] [--plot-only]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "engine"))
from hardware import describe  # noqa: E402
from report import parse, save  # noqa: E402

from freetoken_engine.config import MoeConfig  # noqa: E402

ROUTINGS = {  # name -> (routing, the model's MoE layers)
    "GLM-4.5-Air": (MoeConfig(128, 8, 1408, scoring="sigmoid", biased=True, norm_topk_prob=True), 45),
    "GLM-4.5": (MoeConfig(160, 8, 1536, scoring="sigmoid", biased=True, norm_topk_prob=True,
                          routed_scaling_factor=2.5), 89),
    "DeepSeek-V3 groups": (MoeConfig(256, 8, 2048, scoring="sigmoid", biased=True, norm_topk_prob=True, n_group=8,
                                     topk_group=4, routed_scaling_factor=2.5), 58),
    "ERNIE-4.5-21B-A3B": (MoeConfig(64, 6, 1536, scoring="softmax", biased=True, norm_topk_prob=True,
                                    norm_floor=1e-12), 27),
}


def graph_us(fn, calls: int, rounds: int) -> float:
    """us per call of ``fn()`` replayed ``calls`` times from one CUDA graph (median of ``rounds``)."""
    import gemv
    return gemv.graph_us(fn, [()] * calls, rounds, warm=1)


def measure(args) -> dict:
    from freetoken_engine.kernels.triton.route import route_biased
    from freetoken_engine.layers.moe import biased_route
    rows = []
    for name, (moe, layers) in ROUTINGS.items():
        for t in (int(b) for b in args.batches.split(",")):
            g = torch.Generator(device="cuda").manual_seed(t)
            logits = torch.randn(t, moe.num_experts, device="cuda", generator=g)
            bias = 0.1 * torch.randn(moe.num_experts, device="cuda", generator=g)
            sides = {"torch": lambda: biased_route(logits, bias, moe),
                     "triton": lambda: route_biased(logits, bias, moe, torch.bfloat16)}
            times = {k: [] for k in sides}
            for r in range(args.repeats):                 # alternate the sides' order
                for k in (sides if r % 2 == 0 else reversed(list(sides))):
                    times[k].append(graph_us(sides[k], args.calls, args.rounds))
            us = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"routing": name, "experts": moe.num_experts, "top_k": moe.top_k, "groups": moe.n_group,
                         "tokens": t, "moe_layers": layers, "torch_us": round(us["torch"], 2),
                         "triton_us": round(us["triton"], 2), "speedup": round(us["torch"] / us["triton"], 2),
                         "torch_ms_per_token": round(us["torch"] * layers / 1e3, 3),
                         "triton_ms_per_token": round(us["triton"] * layers / 1e3, 3)})
            print(f"{name:20s} T={t}  torch {us['torch']:7.2f} us  triton {us['triton']:6.2f} us  "
                  f"{us['torch'] / us['triton']:5.2f}x  per token over {layers} layers: "
                  f"{us['torch'] * layers / 1e3:.2f} -> {us['triton'] * layers / 1e3:.2f} ms")
    return {"bench": "route_biased", "hardware": describe(), "when": datetime.now(timezone.utc).isoformat(),
            "command": "python bench/route_biased.py " + " ".join(sys.argv[1:]),
            "method": f"{args.calls} routes in one CUDA graph, median of {args.rounds} replays, "
                      f"median of {args.repeats} alternating repeats; fp32 logits, bf16 weights out",
            "rows": rows}


def plot(result: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    labels = [f"{r['routing']}\nT={r['tokens']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 1.1), 4.5))
    ax.bar([i - 0.2 for i in x], [r["torch_us"] for r in rows], 0.4, label="torch ops (biased_route)")
    ax.bar([i + 0.2 for i in x], [r["triton_us"] for r in rows], 0.4, label="Triton, one launch")
    ax.set_xticks(list(x), labels, fontsize=7, rotation=25, ha="right")
    ax.set_ylabel("us per MoE layer (CUDA graph replay)")
    ax.set_title(f"Biased MoE routing per layer, {result['hardware'].get('gpu', '?')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--calls", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=3)
    parsed = parse(ap, ROOT / "bench/results/route_biased_h200.json", plot)
    if parsed is None:
        return
    if not torch.cuda.is_available():
        sys.exit("route_biased: needs a CUDA GPU")
    save(measure(parsed[0]), parsed[1], plot)


if __name__ == "__main__":
    main()
