"""A decode step's dense projection on the CPU (``kernels/cpu/linear.py``, ft_linear) against a
read of the same bytes, per tuning setting, in one process.

    python bench/cpu_linear.py [--shapes NAMES] [--tokens 1,2] [--x-dtypes float32,bfloat16]
                               [--settings "default; linear_far_pf=0"] [--rounds 5] [--label NAME]

A CPU engine's decode multiplies one token (or a few) by every dense matrix of a layer and by the
LM head: a matrix-vector product bounded by reading the weights once. For each shape, token count,
token dtype and setting, round after round (the settings alternate inside a round, so drift
touches both sides alike):

- **read**: the kernel's threads read the matrix's bytes once (``cpu_experts.read_seconds``), in
  chunks of the size ft_linear hands out (tune.h ``chunk_bytes``), so the read pays the same
  thread wake-ups and stream starts;
- **linear**: ``linear(x, w)`` through Python, as the engine calls it.

Both cycle over copies of the weights that together hold at least twice the last-level cache, so
every call reads its matrix from memory, as a decode step does. GB/s are weight bytes a second
(median over the calls of a round, then over rounds); "of read" is each round's ratio. Writes
bench/results/cpu_linear.json and .png; prints a table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import report  # noqa: E402
from cpu_expert_kernel import hardware  # noqa: E402
from cpu_kernel_tune import parse_settings  # noqa: E402
from expert_call_size import chunk_bytes  # noqa: E402
from freetoken_engine.kernels import cpu_experts as ce  # noqa: E402
from freetoken_engine.kernels.cpu import linear as cl  # noqa: E402

SHAPES = {  # name -> (K, N, weight dtype)
    "smollm2 lm_head fp32": (576, 49152, torch.float32),     # the default model's (float32) head
    "smollm2 mlp up fp32": (576, 1536, torch.float32),
    "qwen3-30b q/k/v": (2048, 5120, torch.bfloat16),
    "qwen3-30b o": (4096, 2048, torch.bfloat16),
    "qwen3-30b lm_head": (2048, 151936, torch.bfloat16),
}


def copies_of(K: int, N: int, dtype: torch.dtype, llc: int) -> list[torch.Tensor]:
    """Copies of one random [N, K] matrix holding at least twice the LLC together (at least 2)."""
    w = (torch.randn(N, K) * 0.02).to(dtype)
    n = max(2, -(-2 * llc // (w.numel() * w.element_size())))
    return [w.clone() for _ in range(n)]


def one_round(ws: list[torch.Tensor], x: torch.Tensor, threads: int) -> dict:
    """The read of every copy, then a linear call on every copy: GB/s (medians over copies)."""
    nbytes = ws[0].numel() * ws[0].element_size()
    ce.tune(read_chunk=chunk_bytes(nbytes, threads))      # the chunk ft_linear hands out
    read = statistics.median(ce.read_seconds(w.view(-1)) for w in ws)
    ce.tune(read_chunk=1 << 20)
    calls = []
    for w in ws:
        t0 = time.perf_counter()
        cl.linear(x, w)
        calls.append(time.perf_counter() - t0)
    call = statistics.median(calls)
    return {"read_gbps": nbytes / read / 1e9, "linear_gbps": nbytes / call / 1e9, "linear_us": call * 1e6}


def run(args) -> dict:
    hw = hardware()
    llc = hw["llc_bytes"] or 32 << 20
    threads = ce.configure().threads
    if not cl.available():
        raise SystemExit("the compiled CPU kernel is unavailable (no C++ compiler?)")
    settings = dict(parse_settings(args.settings))
    defaults = ce.tune()
    print(f"{hw['cpu_model']} | {hw['cpus']} CPUs | LLC {llc >> 20} MiB | kernel {ce.backend_name()}, "
          f"{threads} threads")
    rows = []
    for name in args.shapes.split(","):
        K, N, wdt = SHAPES[name]
        ws = copies_of(K, N, wdt, llc)
        for xdt_name in args.x_dtypes.split(","):
            xdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[xdt_name]
            if wdt == torch.float32 and xdt == torch.bfloat16:
                continue                               # not a pair the engine runs
            for tokens in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(tokens, K).to(xdt)
                one_round(ws, x, threads)                  # warm-up: threads awake, pages touched
                got = {s: [] for s in settings}
                for _ in range(args.rounds):
                    for s, knobs in settings.items():
                        ce.tune(**knobs)
                        got[s].append(one_round(ws, x, threads))
                        ce.tune(**defaults)
                for s, rs in got.items():
                    med = statistics.median
                    rows.append({"shape": name, "K": K, "N": N, "weight_dtype": str(wdt).split(".")[1],
                                 "x_dtype": xdt_name, "tokens": tokens, "setting": s,
                                 "matrix_mb": ws[0].numel() * ws[0].element_size() / 1e6, "copies": len(ws),
                                 **{k: med(r[k] for r in rs) for k in ("read_gbps", "linear_gbps", "linear_us")},
                                 "of_read": med(r["linear_gbps"] / r["read_gbps"] for r in rs), "rounds": rs})
                print(f"{name} {xdt_name} x{tokens} done", flush=True)
        del ws
    print(f"\n{'shape':22} {'x':9} {'tok':>3} {'setting':18} {'MB':>6} {'read':>6} {'linear':>7} {'of read':>7} "
          f"{'us':>7}")
    for r in rows:
        print(f"{r['shape']:22} {r['x_dtype']:9} {r['tokens']:>3} {r['setting']:18} {r['matrix_mb']:6.1f} "
              f"{r['read_gbps']:6.1f} {r['linear_gbps']:7.1f} {r['of_read']:7.2f} {r['linear_us']:7.0f}")
    print("GB/s of weight bytes; read: the same bytes by the kernel's threads in ft_linear's chunks; medians")
    return {"benchmark": "cpu_linear", "label": args.label, "hardware": hw, "threads": threads,
            "backend": ce.backend_name(), "rounds": args.rounds, "settings": settings, "defaults": defaults,
            "method": __doc__, "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    settings = list(result["settings"])
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(len(shapes), 1, figsize=(9, 2.2 * len(shapes) + 0.8), squeeze=False)
    of_read = {(r["setting"], (r["shape"], r["x_dtype"], r["tokens"])): r["of_read"] for r in rows}
    for ax, shape in zip(axes[:, 0], shapes):
        cases = list(dict.fromkeys((r["shape"], r["x_dtype"], r["tokens"]) for r in rows if r["shape"] == shape))
        report.setting_bars(ax, cases, settings, lambda s, case: of_read[(s, case)])
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(cases)), [f"{x} x{t}" for _, x, t in cases], fontsize=7)
        ax.set_ylabel(f"{shape}\nof read", fontsize=7)
        ax.set_ylim(0, 1.15)
    for ax in axes[1:, 0]:
        ax.legend_ = None
    report.finish_cpu_plot(fig, axes[0, 0], result, "Decode projections on the CPU vs a read of their bytes", path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--x-dtypes", default="float32,bfloat16",
                    help="token dtypes (a CPU engine computes in float32 by default)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--label", default="this-machine")
    ap.add_argument("--settings", default="default; linear_far_pf=0",
                    help='kernel tuning knobs per side, e.g. "default; linear_far_pf=0" (cpu_experts.tune)')
    report.main(ap, HERE / "results" / "cpu_linear.json", run, plot)
