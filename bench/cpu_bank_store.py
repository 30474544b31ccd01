"""Benchmark: a bfloat16 MoE checkpoint on a CPU engine computing in float32, its experts and its
attention, dense and LM-head projections kept in bfloat16 (``models/build.bank_store``,
``DecoderLM.narrowable``, stop 61) against the same weights widened to float32 (the rule before),
in one run.

    python bench/cpu_bank_store.py [--layers 8] [--tokens 48] [--rounds 2]

Checkpoint: ``cpu_generate.py``'s ``qwen3moe-bf16`` (Qwen3-30B-A3B's ratios at hidden 1024, 128
experts, top 8, stored in bfloat16 as published), written here, and its packed folder
(``freetoken convert``). Each side runs in a process of its own, the sides alternating,
``--rounds`` times: time to ready, resident memory, the bank's bytes, batch-1 greedy decode tok/s
with every expert in host memory, and its tokens (which must equal the other side's).
Writes bench/results/cpu_bank_store.json and .png; prints a table.
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

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from cpu_generate import CHECKPOINTS  # noqa: E402
from hardware import describe  # noqa: E402

BANKS = ("bfloat16", "float32")
PROMPT = list(range(3, 35))


def side(folder: str, bank: str, tokens: int) -> dict:
    """One engine in this process; ``bank`` float32: the rule before (every weight widened)."""
    from freetoken_engine import LLM, SamplingParams
    from freetoken_engine.models import build
    from freetoken_engine.models.decoder import DecoderLM
    if bank == "float32":
        build.bank_store = lambda dtype, device, source: dtype
        DecoderLM.narrowable = lambda self, tied: set()
    t0 = time.perf_counter()
    llm = LLM(folder)
    ready = time.perf_counter() - t0
    llm.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    out = llm.generate(PROMPT, SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True))
    secs = time.perf_counter() - t0
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    b = llm.runner.bank
    return {"bank": str(b.w13.dtype)[6:], "ready_s": ready, "rss_gb": rss / 1e9, "tok_per_s": tokens / secs,
            "bank_gb": b.expert_bytes * b.total_experts / 1e9, "tokens": out.token_ids}


def run(args) -> dict:
    from freetoken_engine.packed import convert
    from tiny_models import make_tiny_checkpoint
    spec = CHECKPOINTS["qwen3moe-bf16"]
    shape = dict(spec["shape"], num_hidden_layers=args.layers)
    results: dict = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        torch.set_default_dtype(torch.bfloat16)
        try:
            hf = make_tiny_checkpoint(Path(tmp) / "hf", "qwen3_moe", vocab_size=spec["vocab_size"], dtype="bfloat16",
                                      **shape)
        finally:
            torch.set_default_dtype(torch.float32)
        folders = {"safetensors": hf, "packed": convert(hf, Path(tmp) / "packed", progress=False)}
        for r in range(args.rounds):
            for kind, folder in folders.items():
                for bank in BANKS[r % 2:] + BANKS[:r % 2]:
                    cmd = [sys.executable, __file__, "--side", str(folder), bank, str(args.tokens)]
                    res = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                                     .strip().splitlines()[-1])
                    results.setdefault((kind, bank), []).append(res)
                    print(f"round {r + 1}: {kind:11s} bank {res['bank']:8s} {res['tok_per_s']:6.1f} tok/s, "
                          f"ready {res['ready_s']:5.2f} s, resident {res['rss_gb']:.2f} GB", flush=True)
    rows = []
    for (kind, bank), rs in results.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("tok_per_s", "ready_s", "rss_gb")}
        rows.append({"folder": kind, "bank": bank, "bank_gb": rs[0]["bank_gb"], **med,
                     "samples": {k: [round(x[k], 3) for x in rs] for k in ("tok_per_s", "ready_s", "rss_gb")},
                     "tokens_equal_float32_bank": rs[0]["tokens"] == results[(kind, "float32")][0]["tokens"]})
    for row in rows:
        base = next(x for x in rows if x["folder"] == row["folder"] and x["bank"] == "float32")
        row["decode_vs_float32_bank"] = row["tok_per_s"] / base["tok_per_s"]
        row["ready_vs_float32_bank"] = base["ready_s"] / row["ready_s"]
    return {"benchmark": "cpu_bank_store", "hardware": describe(),
            "checkpoint": dict(shape, vocab_size=spec["vocab_size"], dtype="bfloat16"),
            "engine": "device cpu, dtype float32 (the default), every expert in host memory, batch 1, greedy",
            "tokens": args.tokens, "rounds": args.rounds, "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    rows = result["rows"]
    labels = [f"{r['folder']}\n{r['bank']} bank" for r in rows]
    for ax, key, title in zip(axes, ("tok_per_s", "ready_s", "rss_gb"),
                              ("decode tok/s (batch 1)", "time to ready (s)", "resident memory (GB)")):
        ax.bar(labels, [r[key] for r in rows], color=["C0" if r["bank"] == "bfloat16" else "C1" for r in rows])
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"bf16 checkpoint, float32 compute on the CPU ({result['hardware']['cpu'][:30]}, "
                 f"{result['hardware']['cores']} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(result: dict) -> None:
    print(f"\n{'folder':<12}{'bank':<10}{'bank GB':>8}{'tok/s':>8}{'x':>7}{'ready s':>9}{'x':>7}{'RSS GB':>8}  same tokens")
    for r in result["rows"]:
        print(f"{r['folder']:<12}{r['bank']:<10}{r['bank_gb']:>8.2f}{r['tok_per_s']:>8.1f}{r['decode_vs_float32_bank']:>7.2f}"
              f"{r['ready_s']:>9.2f}{r['ready_vs_float32_bank']:>7.2f}{r['rss_gb']:>8.2f}  {r['tokens_equal_float32_bank']}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--side":
        folder, bank, tokens = sys.argv[2:5]
        print(json.dumps(side(folder, bank, int(tokens))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: the temp dir)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "cpu_bank_store.json")
    args = ap.parse_args()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
