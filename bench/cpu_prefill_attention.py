"""Prefill through the engine's general attention path on this machine's CPU: SDPA against the
grouped matmuls it replaced (``Attention.sdpa``, layers/attention.py).

The engine prefills in ``prefill_chunk`` (512) token chunks; each chunk's attention reads every
key before it, so a long prompt's late chunks attend over thousands of keys. The grouped
matmuls held each call's float32 scores ``[heads, Q, L]`` whole; SDPA's fused kernel does not.
Per side, in its own process (so that its peak memory is its own), alternating sides for
``--rounds`` rounds on one checkpoint: prefill seconds for each prompt length (the request's
first token, ``max_new_tokens=1``), and the growth of the process's peak resident memory over
the prompts (``VmHWM`` after the longest one, against before the first). The first token of
every prompt must be the same on both sides.

Checkpoint: a random Qwen3-MoE written by ``save_pretrained`` (float32; hidden 1024, 16 query /
4 KV heads of 128, ``--layers`` layers of 16 experts of 256, top-2, context 8192).

    python bench/cpu_prefill_attention.py [--lengths 1024,4096] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from hardware import describe, peak_rss  # noqa: E402

SIDES = {"sdpa": True, "grouped matmuls": False}
HEADS = 16


def bench_model(folder: Path, layers: int) -> Path:
    """The attention benches' checkpoint: a random Qwen3-MoE (float32; hidden 1024, 16 query / 4 KV
    heads of 128, ``layers`` layers of 16 experts of 256, top-2, context 8192)."""
    from tiny_models import make_tiny_checkpoint
    return make_tiny_checkpoint(folder, "qwen3_moe", hidden_size=1024, intermediate_size=2048,
                                num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=4,
                                head_dim=128, num_experts=16, moe_intermediate_size=256, num_experts_per_tok=2,
                                max_position_embeddings=8192, init_std=0.02)


def run_worker(cmd: list[str], side: str) -> dict:
    """Run one side's worker process; -> the dict it printed on its ``RUN`` line (exits on failure)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RUN ")), None)
    if proc.returncode or line is None:
        sys.exit(f"{side} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[4:])


def worker(model: Path, side: str, lengths: list[int]) -> dict:
    from freetoken_engine import LLM, SamplingParams
    from freetoken_engine.layers.attention import Attention
    Attention.sdpa = SIDES[side]
    llm = LLM(model, dtype="float32")
    one = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([5, 6, 7] * 100, one)                      # compiles and allocates what it can first
    before = peak_rss()
    out = {"side": side, "prompts": []}
    for n in lengths:
        ids = [(37 * i) % 300 + 3 for i in range(n)]
        t0 = time.perf_counter()
        first = llm.generate(ids, one).token_ids
        out["prompts"].append({"tokens": n, "seconds": time.perf_counter() - t0, "first_token": first})
    out["peak_rss_growth_bytes"] = peak_rss() - before
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu_prefill_attention.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.worker:
        print("RUN " + json.dumps(worker(args.model, args.worker, lengths)), flush=True)
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model = bench_model(Path(tmp) / "m", args.layers)
        for r in range(args.rounds):
            for side in SIDES if r % 2 == 0 else reversed(SIDES):
                cmd = [sys.executable, __file__, "--worker", side, "--model", str(model), "--lengths", args.lengths]
                runs.append({"round": r, **run_worker(cmd, side)})
                print(f"round {r} {side:16s} " + "  ".join(f"{p['tokens']} tokens {p['seconds']:.2f} s"
                                                          for p in runs[-1]["prompts"])
                      + f"  peak RSS +{runs[-1]['peak_rss_growth_bytes'] / 1e6:.0f} MB", flush=True)
    summary = []
    for n in lengths:
        row = {"tokens": n}
        for side in SIDES:
            row[side] = statistics.median(p["seconds"] for x in runs if x["side"] == side
                                          for p in x["prompts"] if p["tokens"] == n)
        row["sdpa_speedup"] = row["grouped matmuls"] / row["sdpa"]
        row["same_first_token"] = len({tuple(p["first_token"]) for x in runs for p in x["prompts"]
                                       if p["tokens"] == n}) == 1
        # what one grouped-matmul call held in float32 scores at the longest key length
        row["old_scores_bytes_last_chunk"] = HEADS * min(512, n) * n * 4
        summary.append(row)
    rss = {side: statistics.median(x["peak_rss_growth_bytes"] for x in runs if x["side"] == side) for side in SIDES}
    print(f"{'tokens':>6} {'sdpa s':>8} {'matmuls s':>9} {'speedup':>8} {'same token':>10}")
    for row in summary:
        print(f"{row['tokens']:6d} {row['sdpa']:8.2f} {row['grouped matmuls']:9.2f} {row['sdpa_speedup']:7.2f}x "
              f"{str(row['same_first_token']):>10}")
    print("peak RSS growth (median): " + ", ".join(f"{s} {v / 1e6:.0f} MB" for s, v in rss.items()))
    result = {"benchmark": "cpu_prefill_attention", "hardware": describe(), "method": __doc__,
              "command": " ".join(["python", "bench/cpu_prefill_attention.py"] + sys.argv[1:]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "layers": args.layers,
              "runs": runs, "summary": summary, "peak_rss_growth_bytes_median": rss}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 4))
    rows = result["summary"]
    x = range(len(rows))
    for i, side in enumerate(SIDES):
        a.bar([j + 0.4 * (i - 0.5) for j in x], [r[side] for r in rows], 0.4, label=side)
    a.set_xticks(list(x), [f"{r['tokens']} tokens" for r in rows])
    a.set_ylabel("prefill seconds (median)")
    a.legend(fontsize=8)
    rss = result["peak_rss_growth_bytes_median"]
    b.bar(list(rss), [v / 1e6 for v in rss.values()])
    b.set_ylabel("peak resident memory growth, MB")
    fig.suptitle(f"engine prefill attention, {result['layers']}-layer random Qwen3-MoE, float32\n"
                 f"{result['hardware']['cpu']}, {result['hardware']['cores']} CPUs", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
