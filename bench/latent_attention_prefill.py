"""Prefill of a latent-attention model (DeepSeek-V2-Lite's attention shape) on this machine's CPU:
prompt chunks in the expanded form (``LatentAttention.expand_prompts``: each chunk up-projects its
context's latents to every head's keys and values) against the latent form decode uses (the
engine before), and transformers on the same checkpoint.

The checkpoint is bench/latent_attention_decode.py's (random ``deepseek_v2``, float32, V2-Lite's
attention in ``--layers`` layers). Each prompt length in ``--lengths`` is prefilled in the
engine's CPU chunks of 512 tokens into an empty KV pool, the sides alternating for ``--rounds``
rounds in one process (transformers: one forward over the whole prompt). Reported: the median
seconds per prompt, and whether the last position's logits agree (the next token, and the largest
difference).

    python bench/latent_attention_prefill.py [--lengths 2048,8192] [--layers 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from hardware import describe  # noqa: E402
from latent_attention_decode import SHAPE, model  # noqa: E402
from report import parse, save  # noqa: E402

SIDES = ("expanded", "latent", "transformers")


def run(args) -> dict:
    import torch
    import transformers

    from freetoken_engine import LLM
    from freetoken_engine.executor.inputs import SeqChunk
    from freetoken_engine.layers.mla import LatentAttention
    lengths = [int(n) for n in args.lengths.split(",")]
    times = {n: {s: [] for s in SIDES} for n in lengths}
    logits: dict = {n: {} for n in lengths}
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        folder = model(Path(tmp), args.layers)
        llm = LLM(folder, dtype="float32", max_batch=1, kv_cache_tokens=max(lengths) + 64)
        runner, kv = llm.runner, llm.runner.kv
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                attn_implementation="sdpa").eval()

        def engine(ids: list[int]) -> torch.Tensor:
            blocks = kv.allocate(kv.blocks_for(len(ids)))
            try:
                for start in range(0, len(ids), 512):
                    out = runner.forward([SeqChunk(blocks, start, ids[start:start + 512])])
            finally:
                kv.release(blocks)
            return out[-1]

        for _ in range(args.rounds):
            for n in lengths:
                ids = [(31 * t + 7) % 300 + 3 for t in range(n)]
                for side in SIDES:
                    LatentAttention.expand_prompts = side == "expanded"
                    t0 = time.perf_counter()
                    got = ref(torch.tensor([ids])).logits[0, -1] if side == "transformers" else engine(ids)
                    times[n][side].append(time.perf_counter() - t0)
                    logits[n][side] = got.float()
        LatentAttention.expand_prompts = True
    rows = []
    for n in lengths:
        med = {s: statistics.median(times[n][s]) for s in SIDES}
        base = logits[n]["transformers"]
        rows.append({"tokens": n, "seconds": med, "expanded_vs_latent": med["latent"] / med["expanded"],
                     "expanded_vs_transformers": med["transformers"] / med["expanded"],
                     "same_next_token": all(int(logits[n][s].argmax()) == int(base.argmax()) for s in SIDES),
                     "max_logit_diff": max(float((logits[n][s] - base).abs().max()) for s in SIDES)})
    return {"hardware": describe(), "layers": args.layers, "shape": SHAPE, "chunk": 512, "rows": rows,
            "all_seconds": {str(n): times[n] for n in lengths}}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    rows, width = result["rows"], 0.27
    for j, side in enumerate(SIDES):
        ax.bar([i + (j - 1) * width for i in range(len(rows))], [r["seconds"][side] for r in rows], width,
               label=side, color=["tab:green", "tab:gray", "tab:blue"][j])
    ax.set_xticks(range(len(rows)), [f"{r['tokens']} tokens" for r in rows])
    ax.set_ylabel("prefill, s (median)")
    ax.set_title(f"DeepSeek-V2-Lite attention, {result['layers']} layers\n{result['hardware']['cpu']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    parsed = parse(ap, ROOT / "bench" / "results" / "latent_attention_prefill.json", plot)
    if parsed is None:
        return
    args, out = parsed
    result = run(args)
    print(f"{'tokens':>7s} {'expanded s':>11s} {'latent s':>9s} {'transformers s':>15s} {'vs latent':>10s} same token")
    for r in result["rows"]:
        s = r["seconds"]
        print(f"{r['tokens']:7d} {s['expanded']:11.2f} {s['latent']:9.2f} {s['transformers']:15.2f} "
              f"{r['expanded_vs_latent']:9.2f}x {r['same_next_token']} (max diff {r['max_logit_diff']:.1e})")
    print(result["hardware"]["cpu"])
    save(result, out, plot)


if __name__ == "__main__":
    main()
