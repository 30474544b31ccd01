"""What attention sinks cost a prompt chunk on this machine's CPU: one layer's attention of a
512-token chunk over L keys through the engine's two sink paths (layers/sinks.py): torch's flash
kernel and its log-sum-exp, the sink a factor of each row (the CPU's path), and float32 scores
held a bounded number of query rows at a time (a GPU's path; the first version on the CPU too),
against the same layer without sinks (torch's fused SDPA, every other model's chunks).

Shape: Granite swash's attention (16 query / 4 KV heads of 128; scale 1/128 as its configs set
``attention_multiplier``), float32 and bfloat16. Every side in this one process, alternating,
``--rounds`` rounds, the median kept; each sink side's output is checked against an explicit
softmax with the sink column (float32) before anything is timed.

    python bench/sink_attention.py [--keys 1024,4096,8192] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from hardware import describe  # noqa: E402
from report import parse, save  # noqa: E402

H, KVH, D, CHUNK = 16, 4, 128, 512


def layer(sinks: bool):
    from freetoken_engine.config import ModelConfig, RopeConfig
    from freetoken_engine.layers.attention import Attention
    from freetoken_engine.layers.rope import Rotary
    cfg = ModelConfig(model_type="bench", vocab_size=8, hidden_size=H * D, num_layers=1, num_heads=H, num_kv_heads=KVH,
                      head_dim=D, intermediate_size=8, rms_norm_eps=1e-6, rope=RopeConfig(), max_position_embeddings=1 << 16,
                      attention_multiplier=1 / 128, attn_sinks=sinks)
    attn = Attention(cfg, 0, Rotary(cfg.rope, D, 1 << 16, torch.device("cpu")))
    if sinks:
        with torch.no_grad():
            attn.sinks.copy_(torch.linspace(-2, 4, H))
    return attn


def problem(keys: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, CHUNK, D, generator=g).to(dtype)
    k = torch.randn(1, KVH, keys, D, generator=g).to(dtype)
    v = torch.randn(1, KVH, keys, D, generator=g).to(dtype)
    qpos = torch.arange(keys - CHUNK, keys)
    mask = (torch.arange(keys)[None, :] <= qpos[:, None])[None, None]
    return q, k, v, mask


def explicit(attn, q, k, v, mask) -> torch.Tensor:
    """float32 softmax with the sink as one more column, its weight dropped (the reference)."""
    g = H // KVH
    scores = torch.matmul(q.float(), k.float().repeat_interleave(g, 1).transpose(-1, -2)) * attn.scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = attn.sinks.float().view(1, H, 1, 1).expand(1, H, scores.shape[2], 1)
    probs = torch.softmax(torch.cat((scores, sink), -1), -1)[..., :-1]
    return torch.matmul(probs, v.float().repeat_interleave(g, 1))


def seconds(attn, args, flash: bool, rounds_in: int = 3) -> float:
    from freetoken_engine.layers import sinks
    sinks.FLASH_LSE = flash
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(rounds_in):
            attn._attend(*args)
        return (time.perf_counter() - start) / rounds_in


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="1024,4096,8192")
    ap.add_argument("--rounds", type=int, default=5)
    got = parse(ap, ROOT / "bench" / "results" / "sink_attention.json", plot)
    if got is None:
        return
    args, out = got
    from freetoken_engine.layers import sinks
    with_sinks, plain = layer(True), layer(False)
    sides = {"sinks: flash + lse": (with_sinks, True), "sinks: held scores": (with_sinks, False),
             "no sinks (SDPA)": (plain, True)}
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for keys in (int(x) for x in args.keys.split(",")):
            q, k, v, mask = problem(keys, dtype)
            want = explicit(with_sinks, q, k, v, mask)
            errors = {}
            for name, (attn, flash) in list(sides.items())[:2]:
                sinks.FLASH_LSE = flash
                with torch.no_grad():
                    errors[name] = float((attn._attend(q, k, v, mask).float() - want).abs().max())
                assert errors[name] < (1e-4 if dtype == torch.float32 else 5e-2), f"{name} off by {errors[name]}"
            times = {s: [] for s in sides}
            for _ in range(args.rounds):
                for name, (attn, flash) in sides.items():
                    times[name].append(seconds(attn, (q, k, v, mask), flash))
            med = {s: 1e3 * statistics.median(t) for s, t in times.items()}
            base = med["no sinks (SDPA)"]
            rows.append(dict(dtype=str(dtype).split(".")[1], keys=keys, chunk=CHUNK,
                             ms={s: round(m, 2) for s, m in med.items()},
                             ratio_to_sdpa={s: round(m / base, 2) for s, m in med.items()}, max_abs_error=errors))
            print(f"{rows[-1]['dtype']:8s} keys {keys:6d}: " + "  ".join(
                f"{s} {m:8.2f} ms ({m / base:.2f}x)" for s, m in med.items()))
    sinks.FLASH_LSE = True
    result = dict(benchmark="sink_attention", hardware=describe(), shape=dict(heads=H, kv_heads=KVH, head_dim=D),
                  method=__doc__.split("\n\n")[0], rows=rows)
    save(result, out, plot)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for dtype, style in (("float32", "-o"), ("bfloat16", "--s")):
        rows = [r for r in result["rows"] if r["dtype"] == dtype]
        for side in ("sinks: flash + lse", "sinks: held scores"):
            ax.plot([r["keys"] for r in rows], [r["ratio_to_sdpa"][side] for r in rows], style,
                    label=f"{side}, {dtype}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("keys (512-token chunk)")
    ax.set_ylabel("time / SDPA without sinks")
    ax.set_yscale("log")
    ax.set_title(f"Attention sinks on {result['hardware']['cpu']} ({result['hardware']['cores']} cores)", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
