"""What a speculative draft's verification costs on a GPU with the experts offloaded: decode tok/s
of one request on a random checkpoint in Qwen3-30B-A3B's shapes (``--layers`` layers, a stretched
2-layer checkpoint in ``--stretch`` such as /dev/shm, bench/stretch.py), all experts resident
and with a smaller expert cache (``--fractions``), plain decode (CUDA graphs, and eager) against
drafts of up to K tokens at a fixed acceptance A, in one process, rounds interleaved (the
engine's draft length policy, ``DraftLength``, shortens drafts after misses: drafted/pass).

A random model copies nothing, so the drafts here are not n-gram drafts and the model's own
agreement is not asked: each draft token is kept with probability A (a seeded coin per
position, ``--acceptance``), the rest of the verification runs as in the engine (the pass of
K + 1 tokens, eager, through the expert cache and the q* split; the sampling of every row). So
the table is the cost side of speculation under offload; what A a workload reaches is measured
on real text by ``bench/speculative.py``.

Routing: the MoE bench's locality model (``bench/routing_replay.py``, fitted to the default
model's measured routing) for a plain step; a verification pass of K + 1 tokens replays K + 1
consecutive steps of the same trace (the experts a sequence's next tokens would route to), so
its expert misses are those of K + 1 decode steps together.

    python bench/speculative_offload.py --stretch /dev/shm [--layers 48] [--fractions 1.0,0.25]
        [--ks 2 4] [--acceptance 1.0 0.8 0.5] [--tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from hardware import describe  # noqa: E402
from report import save  # noqa: E402


def verification_tables(model, ks: list[int]) -> None:
    """Give the replayed routers (installed for batch 1) a table for each pass of K + 1 rows:
    row j of step s routes as step s + j of the batch-1 trace."""
    import torch
    for block in model.moe_blocks():
        one = block.gate.tables[1]                                  # [S, L, 1, E]
        steps = one.shape[0]
        for k in ks:
            idx = (torch.arange(steps)[:, None] + torch.arange(k + 1)[None, :]) % steps      # [S, T]
            block.gate.tables.setdefault(k + 1, one[idx.to(one.device), :, 0].permute(0, 2, 1, 3).contiguous())
        break                       # the tables dict is shared by every layer's router


def record_run(r: dict, stats: dict) -> None:
    """One generation's figures into a side's lists: tok/s, passes, draft tokens a pass."""
    r["tok_s"].append(stats["decode_tokens_per_s"])
    r["passes"].append(stats["decode_passes"])
    r["drafted_per_pass"].append(stats["draft_tokens"] / max(1, stats["decode_passes"]))


class Coin:
    """Drafts of K placeholder tokens, each kept with probability ``acceptance``."""

    def __init__(self):
        self.acceptance, self.rng = 1.0, random.Random(0)

    def propose(self, drafter, history, limit=None):
        k = drafter.tokens if limit is None else min(limit, drafter.tokens)
        return [int(history[-1])] * k

    def verify(self, logits, draft, choose):
        for j in range(len(draft) + 1):
            tok = choose(logits[j])
            kept = j < len(draft) and self.rng.random() < self.acceptance
            yield j, (draft[j] if kept else tok), kept
            if not kept:
                return


def run(args) -> dict:
    import torch

    import freetoken_engine.llm as llm_module
    from freetoken_engine import LLM, SamplingParams
    from freetoken_engine.executor.speculate import NgramDrafter
    from routing_replay import install
    from stretch import bench_checkpoint

    work = Path(tempfile.mkdtemp())
    fast = Path(tempfile.mkdtemp(dir=args.stretch)) if args.stretch else None
    try:
        folder, nbytes = bench_checkpoint(work, args.layers, fast, args.shape)
        # a hybrid model's snapshot slots for drafts are made with the engine: it starts drafting
        llm = LLM(folder, device=args.device, dtype="bfloat16", graph_warmup=0, speculative_tokens=max(args.ks))
        runner = llm.runner
        routing = install(runner.model, "locality", [1])
        verification_tables(runner.model, args.ks)
        coin = Coin()
        NgramDrafter.propose = lambda drafter, history, limit=None: coin.propose(drafter, history, limit)
        llm_module.verify = coin.verify
        prompt = [int(t) for t in torch.randint(10, 30000, (32,), generator=torch.Generator().manual_seed(0))]
        params = SamplingParams(max_new_tokens=args.tokens, temperature=0, ignore_eos=True)
        sides = [("plain/graphs", 0, None), ("plain/eager", 0, None)] + [
            (f"K={k} A={a:g}", k, a) for k in args.ks for a in args.acceptance]
        total = runner.bank.total_experts
        rows = []
        for frac in args.fractions:
            runner.resize_expert_cache(max(1, round(frac * total)))
            res = {name: {"tok_s": [], "passes": [], "misses_per_pass": [], "drafted_per_pass": []}
                   for name, _, _ in sides}
            for rnd in range(args.rounds + 1):                   # round 0 warms the cache and the graphs
                for name, k, a in sides:
                    llm.config = dataclasses.replace(llm.config, speculative_tokens=k)
                    coin.acceptance = a or 0.0
                    if runner.graphs is not None:
                        runner.graphs.enabled = name != "plain/eager"
                    before = runner.expert_stats()["misses"]
                    gen = llm.generate(prompt, params)
                    if rnd:
                        r = res[name]
                        record_run(r, gen.stats)
                        r["misses_per_pass"].append((runner.expert_stats()["misses"] - before) / max(1, gen.stats["decode_passes"]))
            base = statistics.median(res["plain/graphs"]["tok_s"])
            for name, k, a in sides:
                r = res[name]
                rows.append({"side": name, "k": k, "acceptance": a, "cache_fraction": frac,
                             "cache_experts": runner.cache.capacity if runner.cache else total,
                             "tok_s": statistics.median(r["tok_s"]), "tok_s_rounds": r["tok_s"],
                             "vs_plain_graphs": statistics.median(r["tok_s"]) / base,
                             "passes": statistics.median(r["passes"]),
                             "misses_per_pass": statistics.median(r["misses_per_pass"]),
                             "drafted_per_pass": statistics.median(r["drafted_per_pass"])})
                print(f"{frac:>5.2f} {name:<14} {rows[-1]['tok_s']:>8.1f} tok/s {rows[-1]['vs_plain_graphs']:>6.2f}x "
                      f"passes {rows[-1]['passes']:>5.0f} drafted/pass {rows[-1]['drafted_per_pass']:>4.1f} "
                      f"misses/pass {rows[-1]['misses_per_pass']:>6.1f}", flush=True)
        if runner.graphs is not None:
            runner.graphs.enabled = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if fast is not None:
            shutil.rmtree(fast, ignore_errors=True)
    return {"benchmark": "speculative_offload", "hardware": describe(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", "bench/speculative_offload.py"] + sys.argv[1:]),
            "method": __doc__, "layers": args.layers, "shape": args.shape, "checkpoint_bytes": nbytes, "routing": routing,
            "fill_fraction": runner.expert_stats()["fill_fraction"], "rows": rows}


def plot(result: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fracs = sorted({r["cache_fraction"] for r in result["rows"]}, reverse=True)
    fig, axes = plt.subplots(1, len(fracs), figsize=(5 * len(fracs), 4), squeeze=False)
    for ax, frac in zip(axes[0], fracs):
        rows = [r for r in result["rows"] if r["cache_fraction"] == frac]
        ax.bar(range(len(rows)), [r["vs_plain_graphs"] for r in rows])
        ax.set_xticks(range(len(rows)), [r["side"] for r in rows], rotation=45, ha="right", fontsize=8)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"experts cached: {frac:.0%}", fontsize=9)
        ax.set_ylabel("decode tok/s / plain (graphs)")
    fig.suptitle(f"speculative verification under offload, {result['layers']}-layer {result.get('shape', 'qwen3-30b')} shapes, "
                 f"{result['hardware'].get('gpu', result['hardware']['cpu'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--shape", default="qwen3-30b", choices=("qwen3-30b", "qwen3.6-hybrid"),
                    help="the checkpoint's shapes (bench/fast_load.py SHAPES)")
    ap.add_argument("--stretch", type=Path, help="a RAM-backed folder (/dev/shm) for the stretched checkpoint")
    ap.add_argument("--fractions", default="1.0,0.25")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--acceptance", type=float, nargs="+", default=[1.0, 0.8, 0.5])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/speculative_offload.json")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    args.fractions = [float(x) for x in args.fractions.split(",")]
    if args.plot_only:
        import json
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    save(run(args), args.out, plot)


if __name__ == "__main__":
    main()
