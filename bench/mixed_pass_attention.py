"""A forward pass that mixes a prompt's chunk with decode tokens, on this machine's CPU: attention
per chunk, the decode tokens through the fused decode kernel (``Attention.by_sequence``,
layers/attention.py), against every sequence padded to the longest chunk and the longest
context (the engine before).

The scheduler runs such a pass whenever a request arrives while others decode: its prompt's
chunk and their next tokens go through the model together. Padded, each of the B sequences held
Qmax query rows and Lmax keys, so ``--decoders`` single tokens beside a ``--chunk``-token chunk
cost as much attention as B chunks. Per side, in its own process (its peak memory is its own),
sides alternating for ``--rounds`` rounds on one checkpoint (bench/cpu_prefill_attention.py's:
random Qwen3-MoE, float32, 16 / 4 heads of 128): ``--decoders`` sequences of ``--context``
tokens are prefilled alone, then one pass runs a ``--chunk``-token chunk (after ``--context``
earlier tokens of its own) beside a next token of each, once untimed and then ``--passes``
times. Reported: the pass's median seconds, the growth of the peak resident memory over the
mixed passes (against the peak after the prompts alone), and the logits' greedy tokens (which
must agree between sides) and their max difference.

    python bench/mixed_pass_attention.py [--decoders 15] [--context 2048] [--chunk 512]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from cpu_prefill_attention import bench_model, run_worker  # noqa: E402
from hardware import describe, peak_rss  # noqa: E402

SIDES = {"by sequence": True, "padded": False}


def worker(model: Path, side: str, decoders: int, context: int, chunk: int, passes: int) -> dict:
    import torch

    from freetoken_engine import LLM
    from freetoken_engine.executor.inputs import SeqChunk
    from freetoken_engine.layers.attention import Attention
    Attention.by_sequence = SIDES[side]
    llm = LLM(model, dtype="float32", max_batch=decoders + 1, kv_cache_tokens=(decoders + 1) * (context + chunk + 16))
    runner, kv = llm.runner, llm.runner.kv
    seqs = [[(31 * i + 7 * t) % 300 + 3 for t in range(context + (chunk if i == 0 else 1))] for i in range(decoders + 1)]
    tables = []
    with torch.inference_mode():
        for ids in seqs:
            blocks = kv.allocate(kv.blocks_for(len(ids)))
            for start in range(0, context, 512):              # the prompts, alone, in 512-token chunks
                runner.forward([SeqChunk(blocks, start, ids[start:min(start + 512, context)])])
            tables.append(blocks)
        step = [SeqChunk(t, context, ids[context:]) for t, ids in zip(tables, seqs)]
        before = peak_rss()                                    # after the prompts alone
        logits = runner.forward(step)                         # untimed: compiles and allocates first
        seconds = []
        for _ in range(passes):
            t0 = time.perf_counter()
            logits = runner.forward(step)
            seconds.append(time.perf_counter() - t0)
    return {"side": side, "seconds": seconds, "peak_rss_growth_bytes": peak_rss() - before, "logits": logits.tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decoders", type=int, default=15)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/mixed_pass_attention.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = (args.decoders, args.context, args.chunk, args.passes)
    if args.worker:
        print("RUN " + json.dumps(worker(args.model, args.worker, *shape)), flush=True)
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model = bench_model(Path(tmp) / "m", args.layers)
        for r in range(args.rounds):
            for side in SIDES if r % 2 == 0 else reversed(SIDES):
                cmd = [sys.executable, __file__, "--worker", side, "--model", str(model), "--decoders",
                       str(args.decoders), "--context", str(args.context), "--chunk", str(args.chunk),
                       "--passes", str(args.passes)]
                runs.append({"round": r, **run_worker(cmd, side)})
                print(f"round {r} {side:12s} pass {statistics.median(runs[-1]['seconds']):.3f} s  "
                      f"peak RSS +{runs[-1]['peak_rss_growth_bytes'] / 1e6:.0f} MB", flush=True)
    import torch
    logits = {side: torch.tensor(next(x["logits"] for x in runs if x["side"] == side)) for side in SIDES}
    summary = {side: {"seconds": statistics.median(s for x in runs if x["side"] == side for s in x["seconds"]),
                      "peak_rss_growth_bytes": statistics.median(x["peak_rss_growth_bytes"]
                                                                 for x in runs if x["side"] == side)}
               for side in SIDES}
    summary["speedup"] = summary["padded"]["seconds"] / summary["by sequence"]["seconds"]
    summary["same_greedy_tokens"] = bool(torch.equal(logits["padded"].argmax(-1), logits["by sequence"].argmax(-1)))
    summary["max_abs_difference"] = float((logits["padded"] - logits["by sequence"]).abs().max())
    for x in runs:
        x.pop("logits")
    print(f"{'side':12s} {'s/pass':>8} {'peak RSS MB':>12}")
    for side in SIDES:
        print(f"{side:12s} {summary[side]['seconds']:8.3f} {summary[side]['peak_rss_growth_bytes'] / 1e6:12.0f}")
    print(f"by sequence {summary['speedup']:.2f}x; same greedy tokens: {summary['same_greedy_tokens']}, "
          f"max |diff| {summary['max_abs_difference']:.2e}")
    result = {"benchmark": "mixed_pass_attention", "hardware": describe(), "method": __doc__,
              "command": " ".join(["python", "bench/mixed_pass_attention.py"] + sys.argv[1:]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "layers": args.layers,
              "decoders": args.decoders, "context": args.context, "chunk": args.chunk, "runs": runs,
              "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = result["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.8))
    a.bar(list(SIDES), [s[side]["seconds"] for side in SIDES])
    a.set_ylabel("seconds per mixed pass (median)")
    b.bar(list(SIDES), [s[side]["peak_rss_growth_bytes"] / 1e6 for side in SIDES])
    b.set_ylabel("peak resident memory growth, MB")
    fig.suptitle(f"a {result['chunk']}-token chunk beside {result['decoders']} decode tokens at "
                 f"{result['context']} tokens of context, {result['layers']}-layer random Qwen3-MoE, float32\n"
                 f"{result['hardware']['cpu']}, {result['hardware']['cores']} CPUs", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
