"""gpt-oss's experts kept in MXFP4 against the same experts dequantized to bfloat16 (what the bank
held before), through the compiled CPU kernel: gpt-oss-20b's expert shape (H 2880, I 2880), calls of
1, 4 and 8 tokens on one to four experts each, a pass over more experts than the last-level cache
holds. The bfloat16 bank holds exactly the MXFP4 bank's values (random codes and scales,
dequantized), so both sides compute the same experts; their outputs are checked against each
other before anything is timed (within 2e-2 of the output scale, the kernels' bf16 tolerance).

Every side in this one process, in turn (each first in one round of ``--rounds``, after a pause),
the median kept; calls from Python (``experts_forward``, the CPU engine's path) and from C
(``calls_seconds``, the GPU engine's CPU branch). Reported: microseconds per expert and the
speed-up, and the bytes each side reads (4.25 bits a value against 16) as GB/s against a
STREAM-style read of the same memory by the kernel's threads.

    python bench/mxfp4_experts.py [--rounds 5] [--experts 48]
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
import report  # noqa: E402
from gated_experts import CALLS, H, I  # noqa: E402  (gpt-oss-20b's expert shape, the same calls)
from hardware import describe  # noqa: E402


def banks(n: int):
    """(MXFP4 rows, their bfloat16 values) of n experts: random codes, scales around 2^-6."""
    from freetoken_engine.kernels import mxfp4
    g = torch.Generator().manual_seed(0)

    def rows(r: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = mxfp4.random_rows((n, r), k, g)
        dense = torch.empty((n, r, k), dtype=torch.bfloat16)
        for e in range(n):
            dense[e] = mxfp4.dequantize(q[e], torch.bfloat16)
        return q, dense

    q13, d13 = rows(2 * I, H)
    q2, d2 = rows(H, I)
    return {"mxfp4": (q13, q2), "bf16": (d13, d2)}


def check(b) -> None:
    from freetoken_engine.kernels import cpu_experts as ce
    x = torch.randn(4, H).to(torch.bfloat16)
    tok, exp = torch.arange(4).repeat_interleave(2), torch.tensor([0, 3, 0, 3, 1, 3, 2, 0])
    want = ce.experts_forward(x, *b["bf16"], tok, exp)
    got = ce.experts_forward(x, *b["mxfp4"], tok, exp)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err <= 2e-2, f"MXFP4 kernel off the bf16 kernel by {err:.3g} of the output scale"


def measure(w13, w2, n_experts: int, tokens: int, per: int, from_c: bool) -> float:
    """Seconds a call: one pass over the bank, ``per`` experts a call, each with every token."""
    from freetoken_engine.kernels import cpu_experts as ce
    x = torch.randn(tokens, H).to(torch.bfloat16)
    tok = torch.arange(tokens).repeat(per)
    exps = torch.stack([torch.arange(s, s + per).repeat_interleave(tokens)
                        for s in range(0, n_experts - per + 1, per)])
    if from_c:
        return ce.calls_seconds(x, w13, w2, tok, exps) / len(exps)
    t0 = time.perf_counter()
    for e in exps:
        ce.experts_forward(x, w13, w2, tok, e)
    return (time.perf_counter() - t0) / len(exps)


def run(args) -> dict:
    from freetoken_engine.kernels import cpu_experts as ce
    b = banks(args.experts)
    check(b)
    nbytes = {k: (w13[0].numel() + w2[0].numel()) * w13.element_size() for k, (w13, w2) in b.items()}
    reads = []
    for _ in range(args.rounds):          # the yardstick: the bf16 bank read once by the kernel's threads
        w13, w2 = b["bf16"]
        reads.append((w13.numel() + w2.numel()) * 2 / (ce.read_seconds(w13) + ce.read_seconds(w2)) / 1e9)
    read = statistics.median(reads)
    print(f"{ce.cpu_features()}\nmemory read (the kernel's threads, STREAM-style): {read:.1f} GB/s; "
          f"an expert: {nbytes['bf16'] / 1e6:.1f} MB bf16, {nbytes['mxfp4'] / 1e6:.1f} MB MXFP4")
    rows = []
    sides = [(fmt, from_c) for from_c in (False, True) for fmt in ("bf16", "mxfp4")]
    for tokens, per in CALLS:
        times = {s: [] for s in sides}
        for r in range(args.rounds):
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                time.sleep(0.2)
                times[side].append(measure(*b[side[0]], args.experts, tokens, per, side[1]))
        for from_c in (False, True):
            med = {fmt: statistics.median(times[(fmt, from_c)]) for fmt in ("bf16", "mxfp4")}
            row = {"tokens": tokens, "experts_per_call": per, "caller": "C" if from_c else "Python",
                   "us_per_expert": {k: v / per * 1e6 for k, v in med.items()},
                   "gb_per_s": {k: per * nbytes[k] / v / 1e9 for k, v in med.items()},
                   "of_read": {k: per * nbytes[k] / v / 1e9 / read for k, v in med.items()},
                   "speedup": med["bf16"] / med["mxfp4"]}
            rows.append(row)
            print(f"{tokens} tok x {per} experts from {row['caller']}: "
                  + ", ".join(f"{k} {row['us_per_expert'][k]:.0f} us/expert ({row['gb_per_s'][k]:.1f} GB/s, "
                              f"{row['of_read'][k]:.0%} of read)" for k in ("bf16", "mxfp4"))
                  + f"; MXFP4 {row['speedup']:.2f}x")
    return {"hardware": describe(), "kernel": ce.cpu_features(), "read_gb_per_s": read,
            "shape": {"hidden": H, "intermediate": I}, "expert_bytes": nbytes,
            "experts_in_pass": args.experts, "rounds": args.rounds, "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if r["caller"] == "Python"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for j, fmt in enumerate(("bf16", "mxfp4")):
        ax.bar([i + j * 0.4 for i in range(len(rows))], [r["us_per_expert"][fmt] for r in rows], 0.4,
               label=f"{fmt} bank")
    ax.set_xticks([i + 0.2 for i in range(len(rows))], [f"{r['tokens']} tok x {r['experts_per_call']}" for r in rows])
    for i, r in enumerate(rows):
        ax.annotate(f"{r['speedup']:.2f}x", (i + 0.4, r["us_per_expert"]["mxfp4"]), ha="center", va="bottom",
                    fontsize=8)
    ax.set_ylabel("microseconds per expert (lower is better)")
    ax.set_title(f"gpt-oss-20b experts on the CPU, from Python ({result['hardware'].get('cpu', '?')[:40]})",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--experts", type=int, default=48,
                    help="experts in a pass (48: 634 MB in MXFP4, 2.4 GB in bf16)")
    report.main(ap, ROOT / "bench" / "results" / "mxfp4_experts.json", run, plot)


if __name__ == "__main__":
    main()
