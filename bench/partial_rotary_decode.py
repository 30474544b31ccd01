"""Decode steps of a partial-rotary model on this machine's CPU: the fused decode attention
(compiled; since this stop it rotates the first r dimensions of each head and passes the rest)
against the unfused torch path that such models took before (``Attention._decode_kernel``
returned None when the rotary covered part of the head).

GLM-4.5/4.6/4.7, GLM-4.5-Air and GLM-4.5V rotate half of each head, Qwen3-Next and Qwen3.5/3.6
a quarter. The checkpoint: a random GLM-4.5-shaped model (float32, hidden 1024, 16 query / 4 KV
heads of 128, rotary over 64 of them, per-head q/k norms, ``--layers`` layers of 16 routed
experts of 256 beside one shared), every expert resident; ``--shape minimax``: MiniMax-M2's
(q/k norms over the whole projection, which the fused path applies before the kernel; before
this stop such layers took the unfused path too). ``--batch`` sequences of ``--context``
tokens are prefilled, then one decode step (a token of each) runs once untimed and
``--steps`` times per round, the sides alternating for ``--rounds`` rounds in one process.
Reported: the median step, and the greedy tokens and logits of both sides (which must agree).

    python bench/partial_rotary_decode.py [--context 2048] [--batch 4] [--layers 4]
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

SIDES = ("fused", "unfused")


def model(folder: Path, layers: int, shape: str) -> Path:
    """GLM-4.5's shape (per-head q/k norms) or MiniMax-M2's (q/k norms over the whole projection,
    applied before the kernel): 16 query / 4 KV heads of 128, half of each rotating."""
    from tiny_models import make_tiny_checkpoint
    common = dict(hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                  head_dim=128, num_experts_per_tok=2, max_position_embeddings=8192, init_std=0.02)
    if shape == "minimax":
        return make_tiny_checkpoint(folder, "minimax_m2", intermediate_size=256, num_local_experts=16, rotary_dim=64,
                                    rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                     "partial_rotary_factor": 0.5}, **common)
    return make_tiny_checkpoint(folder, "glm4_moe", intermediate_size=2048, first_k_dense_replace=0,
                                n_routed_experts=16, moe_intermediate_size=256, n_group=1, topk_group=1, **common)


def run(args) -> dict:
    import torch

    from freetoken_engine import LLM
    from freetoken_engine.executor.inputs import SeqChunk
    from freetoken_engine.layers.attention import Attention
    fused = Attention._decode_kernel
    kernels = {"fused": fused, "unfused": lambda self, x, k_cache: None}
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model(Path(tmp), args.layers, args.shape), dtype="float32", max_batch=args.batch,
                  kv_cache_tokens=args.batch * (args.context + 64))
        runner, kv = llm.runner, llm.runner.kv
        assert runner.mcfg.rotary_dim == 64 and runner.mcfg.head_dim == 128      # half of each head rotates
        seqs = [[(31 * i + 7 * t) % 300 + 3 for t in range(args.context + 1)] for i in range(args.batch)]
        tables = []
        with torch.inference_mode():
            for ids in seqs:
                blocks = kv.allocate(kv.blocks_for(len(ids) + 1))
                for start in range(0, args.context, 512):
                    runner.forward([SeqChunk(blocks, start, ids[start:min(start + 512, args.context)])])
                tables.append(blocks)
            step = [SeqChunk(t, args.context, ids[args.context:]) for t, ids in zip(tables, seqs)]
            times, logits = {s: [] for s in SIDES}, {}
            for _ in range(args.rounds):
                for side in SIDES:
                    Attention._decode_kernel = kernels[side]
                    logits[side] = runner.forward(step).float()        # untimed: warms this side
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        runner.forward(step)
                        times[side].append(time.perf_counter() - t0)
            Attention._decode_kernel = fused
    med = {s: statistics.median(times[s]) for s in SIDES}
    return {"hardware": describe(), "shape": args.shape, "context": args.context, "batch": args.batch,
            "layers": args.layers,
            "rotary_dims": 64, "head_dim": 128, "step_seconds": med, "all_seconds": times,
            "speedup": med["unfused"] / med["fused"],
            "same_tokens": bool(torch.equal(logits["fused"].argmax(-1), logits["unfused"].argmax(-1))),
            "max_logit_diff": float((logits["fused"] - logits["unfused"]).abs().max())}


def plot(result: dict, path: Path) -> None:
    bars(path, SIDES, [1e3 * result["step_seconds"][s] for s in SIDES], "decode step, ms (median)",
         f"{result.get('shape', 'glm')}: partial rotary, {result['batch']} x {result['context']} tokens: "
         f"{result['speedup']:.2f}x\n{result['hardware']['cpu']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("glm", "minimax"), default="glm")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    parsed = parse(ap, ROOT / "bench" / "results" / "partial_rotary_decode.json", plot)
    if parsed is None:
        return
    args, out = parsed
    result = run(args)
    print(f"{'side':10s} {'step ms':>9s}")
    for side in SIDES:
        print(f"{side:10s} {1e3 * result['step_seconds'][side]:9.2f}")
    print(f"fused / unfused: {result['speedup']:.2f}x faster; same greedy tokens: {result['same_tokens']}; "
          f"max logit difference {result['max_logit_diff']:.2e}; {result['hardware']['cpu']}")
    save(result, out, plot)


if __name__ == "__main__":
    main()
