"""Dequantizing an FP8 checkpoint's weights as they are read (``models/loader.dequantize``) against
the plain torch expression (the weight in float32 times the scales expanded to its shape), same
process, same tensors, the same bits out.

Shapes: one layer of Qwen3-30B-A3B's stacked experts in 128x128 blocks (gate/up [128, 1536, 2048],
down [128, 2048, 768]), and one expert's gate projection as a per-expert checkpoint stores it
([768, 2048]). G weights/s = FP8 weights dequantized per second (median of ``--rounds``); a
checkpoint's load adds that time to its read (``freetoken convert`` pays it once). Writes JSON +
PNG (hardware named) and prints a table.

    python bench/fp8_dequant.py [--out bench/results/fp8_dequant_cpu.json] [--plot-only]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "engine"))
from hardware import describe  # noqa: E402
from report import parse, save  # noqa: E402

from freetoken_engine.models.loader import dequantize  # noqa: E402

SHAPES = {"stacked gate/up (128 experts)": (128, 1536, 2048), "stacked down (128 experts)": (128, 2048, 768),
          "one expert's gate": (768, 2048)}
BLOCK = (128, 128)


def plain(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.float().repeat_interleave(BLOCK[0], -2).repeat_interleave(BLOCK[1], -1)
    return (w.float() * full).to(torch.bfloat16)


def seconds(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(args) -> dict:
    rows = []
    for name, shape in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        w = torch.randn(shape, generator=g).to(torch.float8_e4m3fn)
        scale = torch.rand(*shape[:-2], shape[-2] // BLOCK[0], shape[-1] // BLOCK[1], generator=g)
        assert torch.equal(dequantize(w, scale, BLOCK, torch.bfloat16), plain(w, scale))
        t_plain = seconds(lambda: plain(w, scale), args.rounds)
        t_engine = seconds(lambda: dequantize(w, scale, BLOCK, torch.bfloat16), args.rounds)
        n = w.numel() / 1e9
        rows.append({"tensor": name, "shape": list(shape), "plain_gweights_s": round(n / t_plain, 3),
                     "engine_gweights_s": round(n / t_engine, 3), "speedup": round(t_plain / t_engine, 2)})
        print(f"{name:32s} plain {n / t_plain:6.3f} G/s  engine {n / t_engine:6.3f} G/s  {t_plain / t_engine:5.2f}x")
    return {"bench": "fp8_dequant", "hardware": describe(), "when": datetime.now(timezone.utc).isoformat(),
            "command": "python bench/fp8_dequant.py " + " ".join(sys.argv[1:]),
            "method": f"median of {args.rounds} rounds after one untimed; torch threads {torch.get_num_threads()}",
            "rows": rows}


def plot(result: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar([i - 0.2 for i in x], [r["plain_gweights_s"] for r in rows], 0.4, label="float32 temporaries")
    ax.bar([i + 0.2 for i in x], [r["engine_gweights_s"] for r in rows], 0.4, label="loader.dequantize")
    ax.set_xticks(list(x), [r["tensor"] for r in rows], fontsize=8)
    ax.set_ylabel("G FP8 weights / s")
    ax.set_title(f"FP8 -> bfloat16 at load, {result['hardware']['cpu']} ({result['hardware']['cores']} CPUs)",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    parsed = parse(ap, ROOT / "bench/results/fp8_dequant_cpu.json", plot)
    if parsed is not None:
        save(measure(parsed[0]), parsed[1], plot)


if __name__ == "__main__":
    main()
