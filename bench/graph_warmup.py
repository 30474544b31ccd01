"""Decode graphs captured ahead of time (``--graph-warmup``) against captured on first use.

With capture on first use, a request's first decode step at each (batch size, KV width) runs
eagerly and is then captured: a stall in the token stream, again whenever the context crosses a
width (256, 512, ...). ``--graph-warmup N`` captures batch sizes 1..N at every width when the
engine starts (here at every KV width, ``graph_warmup_widths=0``; the engine's default since the
fourteenth session captures the narrowest width at start and the others while a server is idle,
see docs/gpu.md). Per side, in its own process (alternating, ``--rounds`` times, on the same
checkpoint; the first round also fills Triton's kernel cache, so it is reported but the ratios
use the later rounds): the engine's start time and warm-up time, then one request per batch size,
prompts of 240 tokens so that decode crosses the 256 -> 512 width, every decode step timed. The
side ``ahead-of-time-noseed`` also turns off the prefill's seed of the decode expert cache
(``FREETOKEN_PREFILL_SEED=off``): its first decode steps against ``ahead-of-time``'s.

Checkpoint: ``engine_gpu_decode.py``'s (random bf16 weights in Qwen3-30B-A3B's shapes, ``--layers``
layers), expert cache at ``--fraction`` of the experts, q* as calibrated.

    python bench/graph_warmup.py     # on the GPU machine; writes bench/results/graph_warmup.json + .png
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from hardware import describe  # noqa: E402

SIDES = {"on-first-use": 0, "ahead-of-time": 4, "ahead-of-time-noseed": 4}
SIDE_ENV = {"ahead-of-time-noseed": {"FREETOKEN_PREFILL_SEED": "off"}}   # the prefill's seed of the cache off
PROMPT = 240


def worker(model: Path, side: str, fraction: float, batches: list[int], steps: int, device: str) -> dict:
    from freetoken_engine import LLM
    from freetoken_engine.llm import Lockstep
    cfg = json.loads((model / "config.json").read_text())      # every layer is MoE in this checkpoint
    experts = max(1, round(fraction * cfg["num_hidden_layers"] * cfg["num_experts"]))
    t0 = time.perf_counter()
    llm = LLM(model, device=device, dtype="bfloat16", expert_cache_experts=experts, graph_warmup=SIDES[side],
              graph_warmup_widths=0)         # every width ahead of time (the engine's default now: the first)
    start_s = time.perf_counter() - t0
    out = {"side": side, "start_seconds": start_s, "cache_experts": experts, **llm.runner.graph_stats(),
           "requests": []}
    for b in batches:
        before = llm.runner.graph_stats()["decode_graphs"]
        batch = Lockstep(llm, [[(41 * i + 13 * t) % 31000 + 100 for t in range(PROMPT)] for i in range(b)])
        ms = []
        for _ in range(steps):
            t = time.perf_counter()
            batch.step()                        # reads the argmax: the step is complete
            ms.append(1e3 * (time.perf_counter() - t))
        batch.close()
        out["requests"].append({"batch": b, "step_ms": ms, "first_step_ms": ms[0], "max_step_ms": max(ms),
                                "median_step_ms": statistics.median(ms), "total_ms": sum(ms),
                                "captured_during_request": llm.runner.graph_stats()["decode_graphs"] - before})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--stretch", type=Path, default=None, metavar="FAST_DIR",
                    help="a 2-layer packed checkpoint repeated to --layers layers under FAST_DIR (bench/stretch.py)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"some of {', '.join(SIDES)}")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/graph_warmup.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    sides = args.sides.split(",")
    if any(side not in SIDES for side in sides):
        sys.exit(f"--sides: pick from {', '.join(SIDES)}")
    if args.worker:
        print("RUN " + json.dumps(worker(args.model, args.worker, args.fraction, batches, args.steps, args.device)), flush=True)
        return
    from stretch import bench_checkpoint
    work = Path(tempfile.mkdtemp(dir=args.stretch))
    runs = []
    try:
        model, _ = bench_checkpoint(work, args.layers, work if args.stretch else None)
        for r in range(args.rounds):
            for side in sides:
                cmd = [sys.executable, __file__, "--worker", side, "--model", str(model),
                       "--fraction", str(args.fraction), "--batches", args.batches, "--steps", str(args.steps),
                       "--device", args.device]
                proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **SIDE_ENV.get(side, {})})
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RUN ")), None)
                if proc.returncode or line is None:
                    sys.exit(f"{side} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
                runs.append({"round": r, **json.loads(line[4:])})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    later = [x for x in runs if x["round"] > 0] or runs
    print(f"{'round':>5} {'side':<14} {'start s':>8} {'warm-up s':>9} {'batch':>5} {'first ms':>9} "
          f"{'max ms':>8} {'median ms':>9} {'total ms':>9} {'captured':>8}")
    for x in runs:
        for q in x["requests"]:
            print(f"{x['round']:>5} {x['side']:<14} {x['start_seconds']:8.2f} {x['decode_graph_warmup_seconds']:9.2f} "
                  f"{q['batch']:>5} {q['first_step_ms']:9.2f} {q['max_step_ms']:8.2f} {q['median_step_ms']:9.2f} "
                  f"{q['total_ms']:9.1f} {q['captured_during_request']:>8}")
    ratios = {}
    for b in batches:
        def mean(side, field):
            return statistics.mean(q[field] for x in later if x["side"] == side for q in x["requests"] if q["batch"] == b)

        def first4(side):
            return statistics.mean(sum(q["step_ms"][:4]) for x in later if x["side"] == side
                                   for q in x["requests"] if q["batch"] == b)
        r = ratios[f"batch_{b}"] = {}
        for other, name in (("on-first-use", "first_use"), ("ahead-of-time-noseed", "noseed")):
            if other in sides and "ahead-of-time" in sides:
                r.update({f"{f}_{name}_over_ahead": mean(other, f) / mean("ahead-of-time", f)
                          for f in ("first_step_ms", "max_step_ms", "total_ms", "median_step_ms")})
                r[f"first_4_steps_ms_{name}_over_ahead"] = first4(other) / first4("ahead-of-time")
    print(json.dumps(ratios, indent=1))
    result = {"benchmark": "graph_warmup", "hardware": describe(), "method": __doc__,
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "layers": args.layers,
              "command": " ".join(["python", "bench/graph_warmup.py"] + sys.argv[1:]),
              "prompt_tokens": PROMPT, "steps": args.steps, "runs": runs, "ratios_later_rounds": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(later, args.out.with_suffix(".png"))


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted({q["batch"] for x in runs for q in x["requests"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for x in runs:
            q = next(q for q in x["requests"] if q["batch"] == b)
            ax.plot(q["step_ms"], label=f"{x['side']} (round {x['round']})",
                    ls="-" if x["side"] == "ahead-of-time" else "--")
        ax.set_yscale("log")
        ax.set_xlabel(f"decode step (prompt {PROMPT} tokens: width 256 -> 512 at step {256 - PROMPT})")
        ax.set_ylabel("ms per step")
        ax.set_title(f"batch {b}")
        ax.legend(fontsize=7)
    fig.suptitle(describe().get("gpu", "") + ": decode step latency, graphs ahead of time vs on first use")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
