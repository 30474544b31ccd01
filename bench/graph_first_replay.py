"""The first replay of a captured decode graph against the replays after it, and what the
engine's warm-up (which replays each graph it captures once) takes off a request's first step.

In one process on the GPU machine, on ``engine_gpu_decode.py``'s checkpoint (random bf16 weights in
Qwen3-30B-A3B's shapes, ``--layers`` layers, the expert cache at ``--fraction`` of the experts),
graphs warmed for batch sizes 1..``--warm`` at start. Decode steps of a dummy token at the last
position of the first KV width (as the warm-up's), each through ``runner.forward`` and synced:
  * warmed: batch 1, a key the warm-up captured and replayed: ``--steps`` steps;
  * cold: batch ``--warm`` + 1, a key it did not cover: its eager step (captured right after),
    then ``--steps`` replays, the first of them the graph's first launch.
Prints a table and writes JSON + PNG (``--out``).

    python bench/graph_first_replay.py --layers 48 --stretch /dev/shm
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from hardware import describe  # noqa: E402


def steps_ms(runner, batch: int, n: int) -> list[float]:
    """n decode steps of ``batch`` dummy tokens at the first width's last position, ms each."""
    import torch
    width = runner.graphs.widths()[0]
    scratch = runner.kv.allocate(1)
    out = []
    try:
        with torch.inference_mode():
            for _ in range(n):
                chunks = runner.dummy_decode(scratch, width, batch)
                torch.cuda.synchronize()
                t = time.perf_counter()
                runner.forward(chunks)
                torch.cuda.synchronize()
                out.append(1e3 * (time.perf_counter() - t))
    finally:
        runner.kv.release(scratch)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--warm", type=int, default=2, help="batch sizes the warm-up captures (1..N)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stretch", type=Path, default=None, metavar="FAST_DIR")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/graph_first_replay.json")
    args = ap.parse_args()
    import torch
    from freetoken_engine import LLM
    from stretch import bench_checkpoint
    if not torch.cuda.is_available():
        sys.exit("graph_first_replay.py needs a CUDA GPU")
    work = Path(tempfile.mkdtemp(dir=args.stretch))
    try:
        model, _ = bench_checkpoint(work, args.layers, work if args.stretch else None)
        cfg = json.loads((model / "config.json").read_text())
        experts = max(1, round(args.fraction * cfg["num_hidden_layers"] * cfg["num_experts"]))
        llm = LLM(model, device="cuda", dtype="bfloat16", expert_cache_experts=experts, graph_warmup=args.warm)
        runner = llm.runner
        warmed = steps_ms(runner, 1, args.steps)
        cold = steps_ms(runner, args.warm + 1, args.steps + 1)      # eager (capture), then replays
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = {"warmed batch 1 (captured and replayed in the warm-up)": warmed,
            f"cold batch {args.warm + 1} (eager + capture, then replays)": cold}
    for name, ms in rows.items():
        print(f"{name:58s} " + " ".join(f"{x:8.2f}" for x in ms) + "  ms")
    result = {"benchmark": "graph_first_replay", "hardware": describe(), "method": __doc__,
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "layers": args.layers,
              "command": " ".join(["python", "bench/graph_first_replay.py"] + sys.argv[1:]),
              "graph_stats": runner.graph_stats(), "steps_ms": rows,
              "ratios": {"cold_first_replay_over_second": cold[1] / cold[2],
                         "warmed_first_step_over_second": warmed[0] / warmed[1]}}
    print(json.dumps(result["ratios"], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ms in rows.items():
        ax.plot(range(len(ms)), ms, marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("decode step (dummy token)")
    ax.set_ylabel("ms, synced")
    ax.set_title(f"{describe().get('gpu', '')}: first replay of a decode graph, {args.layers} layers", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
