"""What gpt-oss's experts cost the compiled CPU kernel: the same expert calls in gpt-oss-20b's shape
(H 2880, I 2880, bf16) through the kernel as plain experts (silu(gate) * up, no biases), as gpt-oss's
(gate/up biases, the clamped gate: ``cpu_experts.gated_forward``, the first stage's activations
element by element) and through the PyTorch reference of gpt-oss's experts (the engine's CPU path
before the kernel took them), for calls of 1, 4 and 8 tokens on one to four experts each, on experts
beyond the last-level cache (a pass over many experts, as decode's CPU share reads them).

Every side in this one process, in turn (each first in one round of three, after a pause),
``--rounds`` rounds, the median kept; GB/s counts the
expert bytes a call reads, against a STREAM-style read of the same bank by the kernel's threads. The gated kernel's rows are checked against the reference before anything
is timed (bf16: within 2e-2 of the output scale, the kernels' stated tolerance).

    python bench/gated_experts.py [--rounds 5] [--experts 48]
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
import report  # noqa: E402

H = I = 2880
CALLS = [(1, 1), (1, 4), (4, 4), (8, 4)]          # (tokens, experts per call): all tokens on each expert


def bank(n: int):
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(n, 2 * I, H, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(n, H, I, generator=g) * 0.02).to(torch.bfloat16)
    b13 = torch.randn(n, 2 * I, generator=g).to(torch.bfloat16).float()
    return w13, w2, b13


def sides(w13, w2, b13):
    from freetoken_engine.kernels import cpu_experts as ce
    from freetoken_engine.kernels.reference import GatedAct, expert_pairs_forward
    act = GatedAct("swiglu_oai", 1.702, 7.0)
    return {
        "kernel, plain experts": lambda x, tok, exp: ce.experts_forward(x, w13, w2, tok, exp),
        "kernel, gpt-oss experts": lambda x, tok, exp: ce.experts_forward(x, w13, w2, tok, exp, act=act, b13=b13),
        "reference, gpt-oss experts": lambda x, tok, exp: expert_pairs_forward(x, w13, w2, tok, exp, act, b13),
    }, act


def check(fns, act, w13, w2, b13) -> None:
    from freetoken_engine.kernels.reference import expert_pairs_forward
    x = torch.randn(4, H).to(torch.bfloat16)
    tok, exp = torch.arange(4).repeat_interleave(2), torch.tensor([0, 3, 0, 3, 1, 3, 2, 0])
    want = expert_pairs_forward(x, w13, w2, tok, exp, act, b13)
    got = fns["kernel, gpt-oss experts"](x, tok, exp)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err <= 2e-2, f"gated kernel off the reference by {err:.3g} of the output scale"


def measure(fn, n_experts: int, tokens: int, per: int) -> float:
    """Seconds a call: one pass over the bank, ``per`` experts a call, each with every token."""
    x = torch.randn(tokens, H).to(torch.bfloat16)
    tok = torch.arange(tokens).repeat(per)
    starts = range(0, n_experts - per + 1, per)
    t0 = time.perf_counter()
    for s in starts:
        fn(x, tok, torch.arange(s, s + per).repeat_interleave(tokens))
    return (time.perf_counter() - t0) / len(starts)


def run(args) -> dict:
    w13, w2, b13 = bank(args.experts)
    fns, act = sides(w13, w2, b13)
    check(fns, act, w13, w2, b13)
    per_expert = 3 * H * I * 2
    from freetoken_engine.kernels import cpu_experts as ce
    reads = []
    for _ in range(args.rounds):          # the yardstick: the bank read once by the kernel's threads
        reads.append((w13.numel() + w2.numel()) * 2 / (ce.read_seconds(w13) + ce.read_seconds(w2)) / 1e9)
    read = statistics.median(reads)
    print(f"memory read (the kernel's threads, STREAM-style): {read:.1f} GB/s")
    rows = []
    for tokens, per in CALLS:
        times = {name: [] for name in fns}
        names = list(fns)
        for r in range(args.rounds):
            # each side first in turn, a pause before each: torch's OpenMP threads (the reference's)
            # spin for a while after it on the CPUs the kernel's workers are pinned to
            for name in names[r % len(names):] + names[:r % len(names)]:
                time.sleep(0.3)
                times[name].append(measure(fns[name], args.experts, tokens, per))
        med = {name: statistics.median(t) for name, t in times.items()}
        row = {"tokens": tokens, "experts_per_call": per, "ms_per_call": {k: v * 1e3 for k, v in med.items()},
               "gb_per_s": {k: per * per_expert / v / 1e9 for k, v in med.items()},
               "of_read": {k: per * per_expert / v / 1e9 / read for k, v in med.items()},
               "gated_over_plain": med["kernel, gpt-oss experts"] / med["kernel, plain experts"],
               "reference_over_gated": med["reference, gpt-oss experts"] / med["kernel, gpt-oss experts"]}
        rows.append(row)
        print(f"{tokens} tok x {per} experts: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in row["gb_per_s"].items())
              + f"; gated/plain time {row['gated_over_plain']:.2f}x, reference/gated {row['reference_over_gated']:.1f}x")
    return {"hardware": describe(), "read_gb_per_s": read, "shape": {"hidden": H, "intermediate": I, "dtype": "bfloat16"},
            "experts_in_pass": args.experts, "rounds": args.rounds, "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    names = list(rows[0]["gb_per_s"])
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        ax.bar([i + j * width for i in range(len(rows))], [r["gb_per_s"][name] for r in rows], width, label=name)
    ax.set_xticks([i + width for i in range(len(rows))],
                  [f"{r['tokens']} tok x {r['experts_per_call']}" for r in rows])
    ax.axhline(result["read_gb_per_s"], color="k", lw=0.8, ls="--", label="memory read")
    ax.set_ylabel("expert bytes read, GB/s")
    ax.set_title(f"gpt-oss-20b experts on the CPU ({result['hardware'].get('cpu', '?')[:40]})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--experts", type=int, default=48, help="experts in a pass (48: 2.4 GB, beyond any LLC)")
    report.main(ap, ROOT / "bench" / "results" / "gated_experts.json", run, plot)


if __name__ == "__main__":
    main()
