"""A critical-path model of one decode step under the q* split (a model, not a measurement).

Why batch-1 decode with locality routing stays near 0.75 of its bandwidth bound in
``gpu_offload.py``: per layer, m misses (Poisson, mean ``--misses``) are split into q = round(f m)
fills over PCIe (``--fill-us`` each) and m - q experts on the CPU (``--cpu-us`` each), f = q*/m
= T_cpu / (T_pcie + T_cpu); the layer ends when both sides are done, and layers run one after
another with ``--chain-us`` of device work between them (wait, combine, next layer's routing and
control) plus ``--gpu-us`` of GPU experts. Policies:

  whole      whole-expert split (the engine today): layer = max(q T_pcie, (m - q) T_cpu)
  partial    only the first rows of a PCIe-bound layer's fills on the critical path, the CPU
             computing the rest of them from the bank, the fills' remainders copied in the
             background (they delay the next layers' copies)
  stage      a split by stage (not built; docs/gpu.md): of the m - q CPU experts, n have their
             down projection (W2, a third of the bytes, whole rows) copied over PCIe while the
             CPU computes their gate/up (two thirds) first and hands over the activations
             (``--handoff-us``); the GPU's down projection starts when both are there. q and n
             minimise the layer's time
  divisible  the misses split as if divisible, no backlog: m T_pcie T_cpu / (T_pcie + T_cpu)

The defaults are run L's (Qwen3-30B, 32 GB, locality, batch 1: 1.92 misses a layer, 185 us a
9.4 MB fill at 51 GB/s, 99 us a CPU expert at 95 GB/s, about 20 us of chain a layer).

    python bench/decode_split_model.py [--misses 1.92] [--out bench/results/decode_split_model.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def stage_us(mm: int, tp: float, tc: float, handoff: float) -> float:
    """The best layer time with q whole fills and n experts split by stage (see the docstring)."""
    best = float("inf")
    for q in range(mm + 1):
        for n in range(mm - q + 1):
            cpu_s1 = n * tc * 2 / 3                      # the split experts' gate/up first
            cpu = cpu_s1 + (mm - q - n) * tc
            pcie = (q + n / 3) * tp
            gpu_down = max(pcie, cpu_s1 + handoff) if n else pcie
            best = min(best, max(cpu, gpu_down))
    return best


def step_us(policy: str, m: np.ndarray, tp: float, tc: float, chain: float, gpu: float, granule: int,
            handoff: float = 8.0) -> float:
    """Mean step time (us) over the rows of m [steps, layers] (misses per layer)."""
    f = tc / (tp + tc)
    total, backlog = 0.0, 0.0
    for row in m:
        for mm in row:
            q = int(np.floor(f * mm + 0.5))
            c = mm - q
            if policy == "whole":
                t = max(q * tp, c * tc)
            elif policy == "divisible":
                t = mm * tp * tc / (tp + tc)
            elif policy == "stage":
                t = stage_us(int(mm), tp, tc, handoff)
            else:
                x = 1.0 if q == 0 or q <= mm * f else min(1.0, np.ceil(mm * f / q * granule) / granule)
                backlog = max(0.0, backlog - chain)          # copies continue through the chain
                pcie, cpu = backlog + q * x * tp, c * tc + q * (1 - x) * tc
                t = max(pcie, cpu)
                backlog = max(0.0, pcie + q * (1 - x) * tp - t)
            total += chain + t + gpu
    return total / len(m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--misses", type=float, default=1.92, help="mean misses per layer (Poisson)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--fill-us", type=float, default=185.0)
    ap.add_argument("--cpu-us", type=float, default=99.0)
    ap.add_argument("--chain-us", type=float, default=20.0)
    ap.add_argument("--gpu-us", type=float, default=18.0)
    ap.add_argument("--granule", type=int, default=12, help="row granules per expert (768 / 64)")
    ap.add_argument("--handoff-us", type=float, default=8.0,
                    help="stage split: activations to the GPU and its down projection")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/decode_split_model.json")
    args = ap.parse_args()
    m = np.random.default_rng(0).poisson(args.misses, size=(args.steps, args.layers))
    res = {p: step_us(p, m, args.fill_us, args.cpu_us, args.chain_us, args.gpu_us, args.granule,
                      args.handoff_us) / 1e3
           for p in ("whole", "partial", "stage", "divisible")}
    no_chain = step_us("divisible", m, args.fill_us, args.cpu_us, 0.0, args.gpu_us, args.granule) / 1e3
    print(f"{'policy':10} {'ms/step':>8} {'vs whole':>9}")
    for p, ms in res.items():
        print(f"{p:10} {ms:8.2f} {res['whole'] / ms:8.2f}x")
    print(f"divisible without the chain: {no_chain:.2f} ms")
    out = {"benchmark": "decode_split_model", "kind": "model (no hardware measured)", "method": __doc__,
           "parameters": {k: v for k, v in vars(args).items() if k != "out"},
           "ms_per_step": res, "divisible_without_chain_ms": no_chain}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(res) + ["divisible,\nno chain"]
    ax.bar(names, list(res.values()) + [no_chain])
    ax.set_ylabel("modelled ms per decode step")
    ax.set_title(f"q* split critical-path model: {args.misses} misses/layer, {args.layers} layers (a model)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
