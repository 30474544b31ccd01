"""Benchmark: sliding-window layers in a KV store of their own (``cache/kv.py``, stop 62) against
one pool for every layer, in one run.

    python bench/kv_window.py [--prompt 8192] [--tokens 64] [--rounds 2] [--device cpu|cuda]

Two parts:
- *What the engine reserves* for published models at its defaults (a GPU: the model's whole
  context, 32 sequences, 8k prefill steps; a CPU: 512-token steps): the KV cache's bytes either
  way, from the configs (exact: the tensors' sizes, no allocation).
- *What the store costs a step*: a random gpt-oss-shaped checkpoint (alternating 128-token
  windows, hidden 512, 8 layers) in the same process, both sides alternating ``--rounds`` times:
  one prompt of ``--prompt`` tokens, then ``--tokens`` greedy decode tokens; prefill and decode
  tok/s, the KV cache's bytes, the window store's blocks in use, and the tokens (equal, or the
  bench fails).
Writes bench/results/kv_window.json and .png; prints a table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import report  # noqa: E402
from hardware import describe  # noqa: E402
from tiny_configs import GPT_OSS_20B  # noqa: E402

#: published configs, the fields the KV cache depends on
PUBLISHED = {"gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128)}


def reserved(device: str) -> list[dict]:
    from freetoken_engine.cache.kv import kv_pool_bytes, kv_windows, model_kv_bytes
    from freetoken_engine.config import EngineConfig
    from freetoken_engine.executor.budget import default_kv_blocks
    from freetoken_engine.models import family
    rows = []
    for name, raw in PUBLISHED.items():
        m = family(raw["model_type"]).parse(raw)
        cfg = EngineConfig(model=name, device=device)
        context = m.max_position_embeddings
        blocks = default_kv_blocks(cfg, context)
        windows, store = kv_windows(cfg, m, blocks)
        rows.append({"model": name, "device_defaults": device, "context": context, "max_batch": cfg.max_batch,
                     "prefill_tokens": cfg.prefill_tokens, "windowed_layers": len(windows) - windows.count(None),
                     "pool_blocks": blocks, "window_store_blocks": store,
                     "kv_gb_one_pool": kv_pool_bytes(m.kv_layers, blocks * cfg.kv_block_size, m.num_kv_heads,
                                                     m.head_dim, 2) / 1e9,
                     "kv_gb_window_store": model_kv_bytes(cfg, m, blocks, 2) / 1e9})
    return rows


def measure(args) -> dict:
    from freetoken_engine import LLM, SamplingParams
    from tiny_models import make_tiny_checkpoint
    folder = make_tiny_checkpoint(tempfile.mkdtemp() + "/gpt-oss-shaped", "gpt_oss", hidden_size=512,
                                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                  intermediate_size=512, num_local_experts=8, num_experts_per_tok=2,
                                  sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 4,
                                  max_position_embeddings=args.prompt + args.tokens + 64, vocab_size=4096,
                                  init_std=0.02)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 4000, (args.prompt,), generator=gen).tolist()
    opts = dict(device=args.device, max_batch=4)
    engines = {"window store": LLM(folder, **opts), "one pool": LLM(folder, **opts, kv_window_store=False)}
    if not engines["window store"].runner.kv.window_blocks:
        raise SystemExit(f"a {args.prompt}-token context is too short for a window store: use a longer --prompt")
    rows = {s: {"prefill": [], "decode": []} for s in engines}
    tokens = {}
    for r in range(args.rounds):
        for s, llm in engines.items():
            out = llm.generate(prompt, SamplingParams(max_new_tokens=args.tokens, temperature=0, ignore_eos=True))
            rows[s]["prefill"].append(out.stats["prefill_tokens_per_s"])
            rows[s]["decode"].append(out.stats["decode_tokens_per_s"])
            tokens.setdefault(s, out.token_ids)
            if out.token_ids != tokens[s]:
                raise SystemExit(f"{s}: round {r + 1} gave other tokens")
        print(f"round {r + 1}/{args.rounds} done")
    if tokens["window store"] != tokens["one pool"]:
        raise SystemExit("the window store changed the tokens")
    result = []
    for s, llm in engines.items():
        kv = llm.runner.kv
        result.append({"side": s, "prefill_tok_s": statistics.median(rows[s]["prefill"]),
                       "decode_tok_s": statistics.median(rows[s]["decode"]), "rounds": rows[s],
                       "kv_gb": kv.nbytes / 1e9, "pool_blocks": kv.num_blocks, "window_store_blocks": kv.window_blocks})
    return {"checkpoint": "random gpt_oss, hidden 512, 8 layers (4 with 128-token windows), 2 KV heads of 64, "
                          "8 experts top 2, float32", "prompt_tokens": args.prompt, "decode_tokens": args.tokens,
            "sides": result, "tokens_equal": True,
            "ratio_decode": result[0]["decode_tok_s"] / result[1]["decode_tok_s"],
            "ratio_prefill": result[0]["prefill_tok_s"] / result[1]["prefill_tok_s"]}


def run(args) -> dict:
    result = {"benchmark": "kv_window", "hardware": describe(), "device": args.device,
              "reserved": reserved("cuda") + reserved("cpu"), "measured": measure(args)}
    print(f"{'model':14} {'defaults':8} {'one pool GB':>12} {'window store GB':>16}")
    for r in result["reserved"]:
        print(f"{r['model']:14} {r['device_defaults']:8} {r['kv_gb_one_pool']:12.2f} {r['kv_gb_window_store']:16.2f}")
    m = result["measured"]
    print(f"\n{'side':14} {'prefill tok/s':>14} {'decode tok/s':>13} {'KV GB':>8}")
    for s in m["sides"]:
        print(f"{s['side']:14} {s['prefill_tok_s']:14.1f} {s['decode_tok_s']:13.2f} {s['kv_gb']:8.3f}")
    print(f"decode {m['ratio_decode']:.3f}x, prefill {m['ratio_prefill']:.3f}x, same tokens")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    rows = result["reserved"]
    labels = [f"{r['model']}\n{r['device_defaults']}" for r in rows]
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [r["kv_gb_one_pool"] for r in rows], 0.4, color="tab:gray", label="one pool")
    a.bar([i + 0.2 for i in x], [r["kv_gb_window_store"] for r in rows], 0.4, color="tab:green", label="window store")
    a.set_xticks(list(x), labels, fontsize=7)
    a.set_ylabel("KV cache reserved, GB")
    a.legend(fontsize=7)
    m = result["measured"]
    sides = m["sides"]
    b.bar([s["side"] for s in sides], [s["decode_tok_s"] for s in sides], color=["tab:green", "tab:gray"])
    b.set_ylabel("decode tok/s")
    b.set_title(f"{m['prompt_tokens']}-token prompt, {result['hardware'].get('cpu', '')[:30]}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    report.main(ap, HERE / "results" / "kv_window.json", run, plot)


if __name__ == "__main__":
    main()
