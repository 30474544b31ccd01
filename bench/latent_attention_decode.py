"""Decode steps of a latent-attention model (DeepSeek-V2-Lite's attention shape) on this machine's
CPU: the engine on the latent (the up-projections absorbed, ``layers/mla.py``) through its
compiled decode kernel, the same through its general torch path, and transformers, which caches
the latent too but expands every cached token's keys and values per head at each step.

The checkpoint: a random ``deepseek_v2`` model (float32) with V2-Lite's attention (hidden 2048, 16
heads, no query bottleneck, a 512-wide latent, 128 unrotated + 64 rotated query/key dimensions,
values of 128) in ``--layers`` layers, each with 16 routed experts of 256 beside one shared, every
expert resident. One sequence of ``--context`` tokens is prefilled on each side, then a decode step
runs once untimed and ``--steps`` times per round (transformers' cache cut back to the context
after each), the sides alternating for ``--rounds`` rounds in one process. Reported: the median
step, the KV values each token keeps per layer, and whether the sides' next-token logits agree.

    python bench/latent_attention_decode.py [--context 2048] [--layers 2]
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
from report import bars, parse, save  # noqa: E402

SIDES = ("latent, fused", "latent, unfused", "transformers")
SHAPE = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def model(folder: Path, layers: int) -> Path:
    from tiny_models import make_tiny_checkpoint
    return make_tiny_checkpoint(folder, "deepseek_v2", num_hidden_layers=layers, first_k_dense_replace=0,
                                n_routed_experts=16, moe_intermediate_size=256, n_shared_experts=1,
                                num_experts_per_tok=2, topk_method="greedy", n_group=1, topk_group=1,
                                intermediate_size=1024, max_position_embeddings=16384, init_std=0.02, **SHAPE)


def run(args) -> dict:
    import torch
    import transformers

    from freetoken_engine import LLM
    from freetoken_engine.executor.inputs import SeqChunk
    from freetoken_engine.layers.attention import Attention
    fused = Attention._decode_kernel
    kernels = {"latent, fused": fused, "latent, unfused": lambda self, x, k_cache: None}
    ids = [(31 * t + 7) % 300 + 3 for t in range(args.context + 1)]
    times, logits = {s: [] for s in SIDES}, {}
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        folder = model(Path(tmp), args.layers)
        llm = LLM(folder, dtype="float32", max_batch=1, kv_cache_tokens=args.context + 64)
        runner, kv = llm.runner, llm.runner.kv
        blocks = kv.allocate(kv.blocks_for(len(ids) + 1))
        for start in range(0, args.context, 512):
            runner.forward([SeqChunk(blocks, start, ids[start:min(start + 512, args.context)])])
        step = [SeqChunk(blocks, args.context, ids[args.context:])]
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                attn_implementation="sdpa").eval()
        cache = ref(torch.tensor([ids[:args.context]]), use_cache=True).past_key_values
        token = torch.tensor([ids[args.context:]])

        def hf_step():
            out = ref(token, cache=cache, use_cache=True).logits[:, -1]
            cache.crop(-1)                                      # back to the context
            return out

        for _ in range(args.rounds):
            for side in SIDES:
                if side == "transformers":
                    call = hf_step
                else:
                    Attention._decode_kernel = kernels[side]
                    call = lambda: runner.forward(step)                 # noqa: E731
                logits[side] = call().float()                           # untimed: warms this side
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    call()
                    times[side].append(time.perf_counter() - t0)
        Attention._decode_kernel = fused
    med = {s: statistics.median(times[s]) for s in SIDES}
    a = SHAPE
    per_token = {"engine (latent once)": a["kv_lora_rank"] + a["qk_rope_head_dim"],
                 "transformers (latent and rotated key)": a["kv_lora_rank"] + a["qk_rope_head_dim"],
                 "expanded heads (arithmetic)": a["num_attention_heads"] * (a["qk_nope_head_dim"] + a["qk_rope_head_dim"]
                                                                            + a["v_head_dim"])}
    base = logits["transformers"]
    return {"hardware": describe(), "context": args.context, "layers": args.layers, "shape": SHAPE,
            "step_seconds": med, "all_seconds": times, "kv_values_per_token_layer": per_token,
            "speedup_vs_transformers": med["transformers"] / med["latent, fused"],
            "fused_vs_unfused": med["latent, unfused"] / med["latent, fused"],
            "same_next_token": all(bool(torch.equal(logits[s].argmax(-1), base.argmax(-1))) for s in SIDES),
            "max_logit_diff": max(float((logits[s] - base).abs().max()) for s in SIDES)}


def plot(result: dict, path: Path) -> None:
    bars(path, SIDES, [1e3 * result["step_seconds"][s] for s in SIDES], "decode step, ms (median)",
         f"DeepSeek-V2-Lite attention, {result['layers']} layers, {result['context']} tokens: "
         f"{result['speedup_vs_transformers']:.2f}x transformers\n{result['hardware']['cpu']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    parsed = parse(ap, ROOT / "bench" / "results" / "latent_attention_decode.json", plot)
    if parsed is None:
        return
    args, out = parsed
    result = run(args)
    print(f"{'side':18s} {'step ms':>9s}")
    for side in SIDES:
        print(f"{side:18s} {1e3 * result['step_seconds'][side]:9.2f}")
    for name, n in result["kv_values_per_token_layer"].items():
        print(f"KV values per token and layer, {name}: {n}")
    print(f"fused latent / transformers: {result['speedup_vs_transformers']:.2f}x faster; fused / unfused "
          f"{result['fused_vs_unfused']:.2f}x; same next token: {result['same_next_token']}; max logit difference "
          f"{result['max_logit_diff']:.2e}; {result['hardware']['cpu']}")
    save(result, out, plot)


if __name__ == "__main__":
    main()
