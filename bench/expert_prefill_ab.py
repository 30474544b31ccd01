"""A/B of the CPU expert kernel on prompt-sized calls: this working tree against a git revision.

    python bench/expert_prefill_ab.py --old REV [--pairs 3] [--label cpu-2core]

The calls of a 512-token prompt chunk (every token routed to its top-k), in three expert shapes:
the default model's (16 experts, top-15, H 576, I 96), a Qwen3-MoE-like one at hidden 1024
(128 experts, top-8, I 768) and Qwen3-30B-A3B's (H 2048); with float32 tokens on float32 and on
bfloat16 weights (a CPU engine computes in float32 by default and keeps a bf16 checkpoint's
experts in bf16) and bf16 on bf16; on the instruction sets this CPU has (the tiles aside, the
paths of CPUs without AMX: AVX-512-BF16, AVX-512, AVX2). Then the engine itself: the time to the
first token of a 2,048-token prompt (the faster of two) on a Qwen3-MoE-like bf16 checkpoint (H 1024,
8 layers) run in float32. Each case's calls repeat for at least 0.5 s. Each side runs in its own
process (its library built from its own sources: the old side's engine from a temporary
``git worktree`` of ``--old``), alternating old, new, ... ``--pairs`` times; reported per case:
GFLOP/s of each side (medians) and the median of the pairs' new / old ratios. Both sides must give
the same expert outputs (compared by checksum), or the bench fails.
Writes bench/results/expert_prefill_ab.json and .png; prints a table.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SHAPES = {"default": (16, 15, 576, 96), "qwen3moe-h1024": (128, 8, 1024, 768), "qwen3-30b": (128, 8, 2048, 768)}
KINDS = ("fp32/fp32", "fp32/bf16", "bf16/bf16")       # tokens / weights
ISAS = ("auto", "avx512bf16", "avx512", "avx2")


def worker(out: Path) -> None:
    """One side: every case's GFLOP/s and output checksum, then the engine's prefill, into out."""
    import torch

    from freetoken_engine.kernels import cpu_experts as ce
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    got, T = {}, 512
    for shape, (E, k, H, I) in SHAPES.items():
        for kind in KINDS:
            xd, wd = (dt[s] for s in kind.split("/"))
            g = torch.Generator().manual_seed(0)
            w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(wd)
            w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(wd)
            x = torch.randn(T, H, generator=g).to(xd)
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            tok, exp = torch.arange(T).repeat_interleave(k), ids.reshape(-1)
            for isa in ISAS:
                try:
                    ce.configure(isa=isa)
                except ValueError:
                    continue                           # this CPU lacks it
                y = ce.experts_forward(x, w13, w2, tok, exp)
                n, t0 = 0, time.perf_counter()
                while n < 3 or time.perf_counter() - t0 < 0.5:      # small calls: many, for a steady rate
                    ce.experts_forward(x, w13, w2, tok, exp)
                    n += 1
                sec = (time.perf_counter() - t0) / n
                got[f"{isa}/{shape}/{kind}"] = {"gflops": 2 * T * k * 3 * H * I / sec / 1e9,
                                               "checksum": float(y.double().sum()) + float(y.double().abs().sum())}
            del w13, w2
    ce.configure(isa="auto")
    got["engine/qwen3moe-h1024-bf16-in-float32/2048-token prompt"] = {"seconds": engine_prefill()}
    out.write_text(json.dumps(got))


def engine_prefill() -> float:
    import torch

    sys.path.insert(0, str(HERE.parent / "tests"))
    from cpu_generate import CHECKPOINTS
    from freetoken_engine import LLM, SamplingParams
    from tiny_models import make_tiny_checkpoint
    spec = CHECKPOINTS["qwen3moe-bf16"]
    with tempfile.TemporaryDirectory() as tmp:
        torch.set_default_dtype(torch.bfloat16)
        try:
            folder = make_tiny_checkpoint(Path(tmp) / "m", "qwen3_moe", vocab_size=spec["vocab_size"],
                                          dtype="bfloat16", **spec["shape"])
        finally:
            torch.set_default_dtype(torch.float32)
        llm = LLM(folder, dtype="float32")
        prompt = [100 + (i * 7919) % 30000 for i in range(2048)]
        params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
        llm.generate(prompt[:64], params)
        times = []
        for _ in range(2):                             # the faster of two prompts
            t0 = time.perf_counter()
            llm.generate(prompt, params)
            times.append(time.perf_counter() - t0)
        return min(times)


def run_side(engine_root: Path, out: Path) -> dict:
    # the side's engine first; the rest of the path kept (a GPU machine's wheels sit there)
    path = os.pathsep.join(p for p in [str(engine_root / "engine"), os.environ.get("PYTHONPATH", "")] if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run([sys.executable, __file__, "--worker", str(out)], env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{engine_root}: worker failed:\n{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]))
        return
    import report
    from old_tree import old_tree
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="git revision of the old side")
    ap.add_argument("--old-tree", type=Path, default=None, help="a folder with the old side's engine/ (no git)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--label", default="this-machine")
    parsed = report.parse(ap, HERE / "results" / "expert_prefill_ab.json", plot)
    if parsed is None:
        return
    args, out = parsed
    work = Path(tempfile.mkdtemp())
    runs = {"old": [], "new": []}
    with old_tree(args.old, args.old_tree) as old_root:
        for i in range(args.pairs):
            for side, root in (("old", old_root), ("new", HERE.parent)):
                runs[side].append(run_side(root, work / f"{side}{i}.json"))
                print(f"pair {i} {side} done", flush=True)
    rows = []
    for case in runs["new"][0]:
        rate = "gflops" if "gflops" in runs["new"][0][case] else "seconds"
        old = [r[case][rate] for r in runs["old"]]
        new = [r[case][rate] for r in runs["new"]]
        sums = {r[case]["checksum"] for r in runs["old"] + runs["new"]} if rate == "gflops" else set()
        if len(sums) > 1:
            sys.exit(f"{case}: the two sides' outputs differ")
        ratios = [n / o if rate == "gflops" else o / n for n, o in zip(new, old)]
        rows.append({"case": case, "unit": rate, "old": statistics.median(old), "new": statistics.median(new),
                     "speedup": statistics.median(ratios), "pairs_speedup": ratios})
    print(f"\n{'case':58} {'old':>8} {'new':>8} {'speed-up':>9}")
    for r in rows:
        print(f"{r['case']:58} {r['old']:8.2f} {r['new']:8.2f} {r['speedup']:8.2f}x   ({r['unit']})")
    print("GFLOP/s of the calls (engine: seconds to the first token); speed-up: the median of the pairs' ratios; "
          "the same outputs on both sides")
    from hardware import describe
    report.save({"benchmark": "expert_prefill_ab", "hardware": describe(), "label": args.label, "old": args.old,
                 "pairs": args.pairs, "method": __doc__, "rows": rows}, out, plot)
    print(f"wrote {out}")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.bar(range(len(rows)), [r["speedup"] for r in rows], color="tab:green")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), [r["case"].replace("/", "\n", 2) for r in rows], fontsize=5, rotation=90)
    ax.set_ylabel("new / old (median of pairs)")
    ax.set_title(f"CPU expert kernel on a prompt's calls, {result['label']} (old: {result['old']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
