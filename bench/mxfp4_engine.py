"""The engine on a gpt-oss checkpoint as published (MXFP4 experts), its experts kept in 4 bits
(``--expert-format mxfp4``) against dequantized to bfloat16 as before (``dense``): resident memory
after load, time to ready and decode tokens/s at batch 1, in one run (each side in a process of
its own, alternating, ``--rounds`` times; the median kept). The checkpoint is written here: gpt-oss-20b's
widths (H 2880, 32 experts of I 2880, top 4, 64/8 heads of 64, sinks, sliding layers) with
``--layers`` layers and a ``--vocab`` vocabulary, random MXFP4 codes and scales, random routers (the
experts a token takes vary from token to token). Both sides must give the same greedy tokens in
float32; in bfloat16 (what runs) they are reported side by side. On a GPU, ``--cache-gb`` gives
both sides the same expert cache in GB (the 4-bit side's slots hold 3.76x the experts, and each
miss moves 3.76x fewer bytes over PCIe); "all": the engine's default size.

    python bench/mxfp4_engine.py [--layers 4] [--tokens 32] [--rounds 2] [--device cpu]
    python bench/mxfp4_engine.py --device cuda --dtypes bfloat16 --layers 8 --cache-gb 0.8,1.6,all \
        --out bench/results/mxfp4_engine_gpu.json
    python bench/mxfp4_engine.py --device cuda --dtypes bfloat16 --layers 4 --cache-gb all --prefill 4096

``--prefill N`` also times an N-token prompt to its first token on each side, and adds the side
``mxfp4/in-kernel`` (4 bits without the dense scratch of kernels/triton/moe_mx_dense.py).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from hardware import describe  # noqa: E402
import report  # noqa: E402

H = I = 2880
E, TOP_K = 32, 4
PROMPT = [101, 2054, 318, 262, 3139, 286, 4881, 30, 1867, 345, 612, 11, 290, 257, 1110, 13]


def write(folder: Path, layers: int, vocab: int) -> int:
    """The published form's tensors under their checkpoint names; bytes written."""
    from safetensors.torch import save_file

    from freetoken_engine.layers.rope import Rotary
    from freetoken_engine.models import family
    from freetoken_engine.models.decoder import DecoderLM
    raw = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": H,
           "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
           "intermediate_size": I, "num_local_experts": E, "num_experts_per_tok": TOP_K, "sliding_window": 128,
           "attention_bias": True, "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 150000,
           "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "quantization_config": {"quant_method": "mxfp4"}}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(raw))
    fam = family("gpt_oss")
    cfg = fam.parse(raw)
    with torch.device("meta"):
        model = DecoderLM(cfg, Rotary(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings, "meta"))
    g = torch.Generator().manual_seed(0)
    total = 0
    dense = {}
    for name, p in model.named_parameters():
        how = fam.source(cfg, name)
        key = how[0] if how else name
        scale = 1.0 if name.endswith("norm.weight") else (0.3 if "router" in key else 0.02)
        t = torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * scale
        dense[key] = t.to(torch.bfloat16)
    save_file(dense, str(folder / "dense.safetensors"), metadata={"format": "pt"})
    total += (folder / "dense.safetensors").stat().st_size
    for layer in range(layers):
        gate_up, down = fam.fused_expert_keys(layer)
        tensors = {}
        for key, rows, k in ((gate_up, 2 * I, H), (down, H, I)):
            tensors[key + "_blocks"] = torch.randint(0, 256, (E, rows, k // 32, 16), dtype=torch.uint8, generator=g)
            tensors[key + "_scales"] = torch.randint(118, 123, (E, rows, k // 32), dtype=torch.uint8, generator=g)
        name = folder / f"experts{layer}.safetensors"
        save_file(tensors, str(name), metadata={"format": "pt"})
        total += name.stat().st_size
    return total


def side(folder: str, fmt: str, dtype: str, tokens: int, device: str, cache: str, prefill: int, warm: int = 2) -> dict:
    """One engine in this process: its resident memory, time to ready, decode rate, and with
    ``prefill`` the time of a prompt of that many tokens to its first token (after one the same
    length, so that nothing it times compiles). ``mxfp4/in-kernel``: 4 bits with every call's
    slots decoded in the kernels' tiles (no dense scratch, moe_mx_dense.MX_DENSE_PAIRS None).
    ``warm``: tokens decoded before the timed ones (enough, and a cache that holds every expert
    has them all resident: the timed rate is then the kernels', not the first fills')."""
    from freetoken_engine import LLM, SamplingParams
    if fmt == "mxfp4/in-kernel":
        from freetoken_engine.kernels.triton import moe_mx_dense
        moe_mx_dense.MX_DENSE_PAIRS = None
    t0 = time.perf_counter()
    llm = LLM(folder, device=device, dtype=dtype, expert_format=fmt.split("/")[0],
              expert_cache_gb=None if cache == "all" else float(cache))
    ready = time.perf_counter() - t0
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    greedy = SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(PROMPT, SamplingParams(max_new_tokens=warm, temperature=0, ignore_eos=True))
    missed = llm.runner.expert_stats()["misses"]      # the engine's count since it started
    t0 = time.perf_counter()
    out = llm.generate(PROMPT, greedy)
    secs = time.perf_counter() - t0
    first = None
    if prefill:
        one = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
        prompt = [int(t) for t in torch.randint(100, 1000, (prefill,), generator=torch.Generator().manual_seed(1))]
        llm.generate(prompt, one)
        t1 = time.perf_counter()
        llm.generate(prompt, one)
        first = time.perf_counter() - t1
    return {"prefill_s": first, "format": fmt, "dtype": dtype, "cache": cache, "ready_s": ready, "rss_gb": rss / 1e9,
            "bank_gb": llm.runner.bank.expert_bytes * llm.runner.bank.total_experts / 1e9,
            "tok_per_s": tokens / secs, "tokens": out.token_ids, "misses": out.stats["misses"] - missed,
            "cached_experts": llm.runner.cache.capacity if llm.runner.cache is not None else None}


def run(args) -> dict:
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp) / "gpt-oss-mxfp4"
        size = write(folder, args.layers, args.vocab)
        print(f"wrote {size / 1e9:.2f} GB ({args.layers} layers)")
        results = {}
        keys = [(dtype, cache) for dtype in args.dtypes.split(",") for cache in args.cache_gb.split(",")]
        fmts = ["mxfp4", "dense"] + (["mxfp4/in-kernel"] if args.prefill else [])
        for r in range(args.rounds):
            for fmt in fmts[r % len(fmts):] + fmts[:r % len(fmts)]:
                for dtype, cache in keys:
                    cmd = [sys.executable, __file__, "--side", str(folder), fmt, dtype, str(args.tokens), args.device,
                           cache, str(args.prefill), str(args.warm_tokens)]
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                    res = json.loads(out.strip().splitlines()[-1])
                    results.setdefault((fmt, dtype, cache), []).append(res)
                    pre = f", {args.prefill}-token prompt {res['prefill_s']:.3f} s" if args.prefill else ""
                    print(f"round {r + 1}: {fmt:5s} {dtype:8s} cache {cache:4s} {res['tok_per_s']:7.2f} tok/s{pre}, "
                          f"ready {res['ready_s']:.1f} s, resident {res['rss_gb']:.2f} GB, misses {res['misses']}, "
                          f"cached experts {res['cached_experts']}")
    rows = []
    for dtype, cache in keys:
        four, dense = results[("mxfp4", dtype, cache)], results[("dense", dtype, cache)]
        med = lambda rs, k: statistics.median(x[k] for x in rs)   # noqa: E731
        row = {"dtype": dtype, "cache_gb": cache, "tok_per_s": {"mxfp4": med(four, "tok_per_s"), "dense": med(dense, "tok_per_s")},
               "cached_experts": {"mxfp4": four[0]["cached_experts"], "dense": dense[0]["cached_experts"]},
               "misses": {"mxfp4": four[0]["misses"], "dense": dense[0]["misses"]},
               "ready_s": {"mxfp4": med(four, "ready_s"), "dense": med(dense, "ready_s")},
               "rss_gb": {"mxfp4": med(four, "rss_gb"), "dense": med(dense, "rss_gb")},
               "bank_gb": {"mxfp4": four[0]["bank_gb"], "dense": dense[0]["bank_gb"]},
               "same_tokens": four[0]["tokens"] == dense[0]["tokens"]}
        row["speedup"] = row["tok_per_s"]["mxfp4"] / row["tok_per_s"]["dense"]
        if args.prefill:
            sides = {f: results[(f, dtype, cache)] for f in fmts}
            row["prefill_s"] = {f: med(rs, "prefill_s") for f, rs in sides.items()}
            row["prefill_tok_per_s"] = {f: args.prefill / v for f, v in row["prefill_s"].items()}
            print(f"{dtype}, cache {cache}: a {args.prefill}-token prompt to its first token: "
                  + ", ".join(f"{f} {v:.3f} s" for f, v in row["prefill_s"].items()))
        if dtype == "float32":
            assert row["same_tokens"], "4-bit and dense experts gave different float32 tokens"
        rows.append(row)
        print(f"{dtype}, cache {cache}: {row['tok_per_s']['mxfp4']:.2f} vs {row['tok_per_s']['dense']:.2f} tok/s "
              f"({row['speedup']:.2f}x), resident {row['rss_gb']['mxfp4']:.2f} vs {row['rss_gb']['dense']:.2f} GB, "
              f"ready {row['ready_s']['mxfp4']:.1f} vs {row['ready_s']['dense']:.1f} s, same tokens {row['same_tokens']}")
    return {"hardware": describe(), "device": args.device, "layers": args.layers, "vocab": args.vocab,
            "tokens": args.tokens, "warm_tokens": args.warm_tokens, "rounds": args.rounds, "prefill_tokens": args.prefill, "checkpoint_gb": size / 1e9,
            "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
    for ax, key, label in ((axes[0], "tok_per_s", "decode tok/s (batch 1)"), (axes[1], "rss_gb", "resident GB")):
        for j, fmt in enumerate(("dense", "mxfp4")):
            ax.bar([i + 0.4 * j for i in range(len(rows))], [r[key][fmt] for r in rows], 0.4, label=fmt)
        ax.set_xticks([i + 0.2 for i in range(len(rows))], [f"{r['dtype']}\ncache {r.get('cache_gb', 'all')}" for r in rows],
                      fontsize=7)
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"gpt-oss ({result['layers']} layers of 20b's widths) on {result['device']}, "
                 f"{result['hardware'].get('cpu', '?')[:40]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--side":
        folder, fmt, dtype, tokens, device, cache, prefill, warm = sys.argv[2:10]
        res = side(folder, fmt, dtype, int(tokens), device, cache, int(prefill), int(warm))
        print(json.dumps(res))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="4: the float32 dense side holds 12.7 GB of experts")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cache-gb", default="all", help="expert cache budgets in GB, comma-separated, or all (a GPU's)")
    ap.add_argument("--prefill", type=int, default=0,
                    help="also time a prompt of this many tokens to its first token (and 4 bits without the dense scratch)")
    ap.add_argument("--dir", default=None, help="where the checkpoint is written (default: the temp dir)")
    ap.add_argument("--warm-tokens", type=int, default=2,
                    help="tokens decoded before the timed ones (e.g. 128 with --cache-gb all: every expert resident)")
    report.main(ap, ROOT / "bench" / "results" / "mxfp4_engine.json", run, plot)


if __name__ == "__main__":
    main()
