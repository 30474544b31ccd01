"""Benchmark: the CPU engine's decode steps through fused layers (``executor/cpu_decode.py``, two
compiled calls a layer) against the same engine running the layers' modules, in one process.

    python bench/fused_cpu_decode.py [--tokens 96] [--rounds 3] [--only default-bf16,...]

Models: the embedded default model (SmolLM2-135M as 16 experts a layer, 30 layers) in float32
and bfloat16, a random checkpoint in Qwen3-30B-A3B's ratios at hidden 1024 (8 layers, 128
experts, top-8, bfloat16: ``bench/cpu_generate.py``'s ``qwen3moe-bf16``), a hybrid in Qwen3.6's
layout at hidden 1024 (``HYBRID``: its MoE halves fused, its attention and DeltaNet layers
through their modules) and 4 layers of
gpt-oss-20b's widths with its experts in MXFP4 as published (``bench/mxfp4_engine.py``'s
checkpoint, kept in 4 bits, computed in bfloat16). Per model one engine;
the sides differ only in the model's ``cpu_decode`` (None: every layer's modules run), and
alternate, which first, ``--rounds`` times: batch 1 (greedy ``generate`` of ``--tokens``
tokens, its decode tok/s) and batch 4 (four prompts decoded together, ``Lockstep``). The tokens
of both sides must be equal (the fused path is bit for bit the unfused one), or the bench fails.
Writes bench/results/fused_cpu_decode.json and .png; prints a table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import report  # noqa: E402
from hardware import describe  # noqa: E402

PROMPT = "Write a long story about a dragon who learns to bake bread."
#: Qwen3.6-35B-A3B's layout at half its width: 3 Gated DeltaNet layers to 1 gated attention
#: layer, experts of I = H / 4 with a shared one, top-8 (128 experts instead of 256)
HYBRID = dict(hidden_size=1024, num_hidden_layers=8, moe_intermediate_size=256, num_experts=128, num_experts_per_tok=8,
              shared_expert_intermediate_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
              linear_num_value_heads=16, linear_num_key_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
              linear_conv_kernel_dim=4, init_std=0.02, max_position_embeddings=4096)


def models(only: set[str] | None, tmp: Path):
    """(name, folder, dtype) of each model measured, writing the random checkpoints first."""
    want = lambda name: not only or name in only      # noqa: E731
    from freetoken_engine.models.default import default_model_dir
    for name, dtype in (("default-fp32", "float32"), ("default-bf16", "bfloat16")):
        if want(name):
            yield name, default_model_dir(progress=False), dtype
    if want("qwen3moe-bf16"):
        from cpu_generate import CHECKPOINTS
        from tiny_models import make_tiny_checkpoint
        spec = CHECKPOINTS["qwen3moe-bf16"]
        torch.set_default_dtype(torch.bfloat16)
        try:
            folder = make_tiny_checkpoint(tmp / "qwen3moe", "qwen3_moe", vocab_size=spec["vocab_size"],
                                          dtype="bfloat16", **spec["shape"])
        finally:
            torch.set_default_dtype(torch.float32)
        yield "qwen3moe-bf16", folder, "bfloat16"
    if want("qwen3.6-like-bf16"):
        from tiny_models import make_tiny_checkpoint
        torch.set_default_dtype(torch.bfloat16)
        try:
            folder = make_tiny_checkpoint(tmp / "hybrid", "qwen3_5_moe_text", vocab_size=32768, dtype="bfloat16",
                                          **HYBRID)
        finally:
            torch.set_default_dtype(torch.float32)
        yield "qwen3.6-like-bf16", folder, "bfloat16"
    if want("gpt-oss-mxfp4"):
        from mxfp4_engine import write
        write(tmp / "gpt-oss", 4, 32768)
        yield "gpt-oss-mxfp4", tmp / "gpt-oss", "bfloat16"


def batch1(llm, ids: list[int], n: int) -> tuple[float, list[int]]:
    from freetoken_engine import SamplingParams
    got = llm.generate(ids, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
    return got.stats["decode_tokens_per_s"], got.token_ids


def lockstep(llm, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    """The prompts decoded together (``Lockstep``) for n steps after the first: (tok/s, tokens)."""
    from freetoken_engine.llm import Lockstep
    steps = Lockstep(llm, prompts)
    try:
        steps.step()
        t0 = time.perf_counter()
        for _ in range(n):
            steps.step()
        return len(prompts) * n / (time.perf_counter() - t0), steps.tokens
    finally:
        steps.close()


def batch4(llm, ids: list[int], n: int) -> tuple[float, list[list[int]]]:
    return lockstep(llm, [ids, ids[3:], ids[:-4], ids[1:] * 2], n)


def measure(name: str, folder: Path, dtype: str, args) -> dict:
    from freetoken_engine import LLM
    llm = LLM(folder, dtype=dtype)
    fused = llm.runner.model.cpu_decode
    ids = llm.tokenizer.encode(PROMPT) if llm.tokenizer else list(range(11, 43))   # (the gpt-oss folder has none)
    rates = {(s, b): [] for s in ("fused", "modules") for b in (1, 4)}
    tokens = {}
    batch1(llm, ids, 8)                                  # warm: the kernels' library, the pool
    for r in range(args.rounds):
        for side in (("fused", "modules") if r % 2 == 0 else ("modules", "fused")):
            llm.runner.model.cpu_decode = fused if side == "fused" else None
            for b, fn in ((1, batch1), (4, batch4)):
                rate, toks = fn(llm, ids, args.tokens if b == 1 else args.tokens // 4)
                rates[side, b].append(rate)
                if tokens.setdefault((b, r), toks) != toks:
                    raise SystemExit(f"{name}: the fused and unfused tokens differ at batch {b}")
    llm.runner.model.cpu_decode = fused
    layers = len(llm.runner.model.model.layers)
    row = {"model": name, "dtype": dtype, "layers": layers, "fused_layers": len(fused.fused) if fused else 0}
    for b in (1, 4):
        f, m = rates["fused", b], rates["modules", b]
        row[f"batch{b}"] = {"fused_tok_s": statistics.median(f), "modules_tok_s": statistics.median(m),
                            "ratio": statistics.median(x / y for x, y in zip(f, m)),
                            "fused_rounds": f, "modules_rounds": m}
    return row


def each_model(args, measure) -> list[dict]:
    """``measure(name, folder, dtype, args)`` of each model ``--only`` names (all: none named)."""
    only = set(args.only.split(",")) if args.only else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, folder, dtype in models(only, Path(tmp)):
            rows.append(measure(name, folder, dtype, args))
            print(f"{name}: done", flush=True)
    return rows


def run(args) -> dict:
    rows = each_model(args, measure)
    print(f"\n{'model':15} {'layers':>8} {'b1 fused':>9} {'b1 mod':>8} {'ratio':>6} {'b4 fused':>9} {'b4 mod':>8} {'ratio':>6}")
    for r in rows:
        b1, b4 = r["batch1"], r["batch4"]
        print(f"{r['model']:15} {r['fused_layers']:>3}/{r['layers']:<4} {b1['fused_tok_s']:9.1f} {b1['modules_tok_s']:8.1f} "
              f"{b1['ratio']:5.2f}x {b4['fused_tok_s']:9.1f} {b4['modules_tok_s']:8.1f} {b4['ratio']:5.2f}x")
    print("tok/s: medians of the rounds; ratio: the median of the rounds' ratios; the same tokens on both sides")
    return {"benchmark": "fused_cpu_decode", "hardware": describe(), "rounds": args.rounds,
            "decode_tokens": args.tokens, "rows": rows, "tokens_equal": True}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [f"{r['model']}\nbatch {b}" for r in rows for b in (1, 4)]
    fused = [r[f"batch{b}"]["fused_tok_s"] for r in rows for b in (1, 4)]
    mods = [r[f"batch{b}"]["modules_tok_s"] for r in rows for b in (1, 4)]
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], fused, 0.4, color="tab:green", label="fused layers")
    ax.bar([i + 0.2 for i in x], mods, 0.4, color="tab:gray", label="layers' modules")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"CPU decode, {result['hardware'].get('cpu', '')[:40]}, {result['hardware'].get('cores')} CPUs",
                 fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def arguments(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The command line of a bench over ``models``: --tokens, --rounds, --only."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--only", default="", help="comma-separated: default-fp32, default-bf16, qwen3moe-bf16, qwen3.6-like-bf16, "
                    "gpt-oss-mxfp4")
    return ap


def main() -> None:
    report.main(arguments(__doc__, 3), HERE / "results" / "fused_cpu_decode.json", run, plot)


if __name__ == "__main__":
    main()
