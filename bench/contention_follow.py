"""GPU decode, idle and beside busy processes: the engine's q* (corrected for the CPU's rate on the
model's experts, following CPU contention) against the calibrated q* and fixed splits.

The calibrated split q* gives the CPU the share of each step's misses it computes in time, at the
rate the calibration measured on 9.4 MB experts with all its CPUs. The engine
(``executor/cpu_contention.py``) measures the rate on the model's own experts when it starts, and
again when its kernel pool shows another process on its CPUs (a gaming PC runs it beside a game),
and moves the split by what it finds. Fixed splits (``cpu=X``: ``--cpu-expert-fraction X``) show
where the best split lies in each condition.

Each side runs in a fresh process (the engine built once, then ``--requests`` greedy requests of
``--tokens`` tokens, one after another, like an agent's turns), every side in every condition, the
sides alternating within each round:

* conditions: ``idle``; ``busy-last`` (``--hogs`` busy-looping processes pinned to the last CPUs,
  where the kernel's pinned workers sit); ``busy-free`` (the same, placed by the scheduler);
* sides (``--sides``): ``follow`` (the default), ``calibrated`` (``--no-cpu-rate-probe``: the
  calibrated q* as measured), ``cpu=X`` (the share X of misses on the CPU, fixed).

The host is calibrated once, idle, before the first round (``freetoken calibrate``; cached, so
every side starts from the same q*: a calibration beside the busy processes is not cached and
each process would measure its own). The first request of each process is left out of the
figures (the follower needs a second of decode to notice and measure; every side gets the same
treatment). Prints a table of median decode tokens/s per side and condition and each side over
the calibrated one, with the fill fraction each side ended on; writes JSON (hardware named) and a
PNG.

    python bench/contention_follow.py [--checkpoint qwen3moe-bf16] [--cache-experts 256] [--hogs 8]
        [--rounds 2] [--requests 5] [--tokens 256] [--sides follow,calibrated,cpu=0.3] [--conditions idle,busy-last]
        [--label h200] [--out bench/results/contention_follow.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_contention import CONDITIONS, plot, start_hogs, stop_hogs, write_checkpoint  # noqa: E402
from hardware import describe  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CALIBRATED = "calibrated"
PROMPT = [5, 17, 99, 200, 3, 44, 12, 300, 8, 9, 77, 150]


def child(args) -> None:
    """One side: the engine, then the requests; prints one JSON line."""
    from freetoken_engine import LLM, SamplingParams
    side = args.child
    fixed = dict(cpu_expert_fraction=float(side[4:])) if side.startswith("cpu=") else {}
    llm = LLM(args.model, device="cuda", expert_cache_experts=args.cache_experts,
              cpu_rate_probe=side != CALIBRATED, **fixed)
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0, ignore_eos=True)
    rates, fractions = [], []
    for i in range(args.requests):
        g = llm.generate([p + i for p in PROMPT], params)
        rates.append(g.stats["decode_tokens_per_s"])
        fractions.append(g.stats["expert_cache"]["fill_fraction"])
    print(json.dumps({"rates": rates, "fill_fractions": fractions,
                      "follower": llm.runner.expert_stats().get("cpu_contention")}))


def engine_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "engine"), os.environ.get("PYTHONPATH", "")]))


def run_side(args, side: str) -> dict:
    cmd = [sys.executable, __file__, "--child", side, "--model", args.model, "--cache-experts",
           str(args.cache_experts), "--requests", str(args.requests), "--tokens", str(args.tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=engine_env(), timeout=900)
    if proc.returncode:
        sys.exit(f"{side}: failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--sides", default="follow,calibrated,cpu=0.3,cpu=0.45")
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--model", default=None, help="model folder (default: --checkpoint written to a temp folder)")
    ap.add_argument("--checkpoint", default="qwen3moe-bf16", choices=("qwen3moe-bf16", "medium"))
    ap.add_argument("--cache-experts", type=int, default=256)
    ap.add_argument("--hogs", type=int, default=8, help="busy processes in the busy conditions")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--label", default="this-machine")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/contention_follow.json")
    args = ap.parse_args()
    if args.child:
        return child(args)
    args.sides, args.conditions = args.sides.split(","), args.conditions.split(",")
    if args.model is None:
        args.model = str(write_checkpoint(args.checkpoint))
    subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "calibrate", "--device", "cuda"],
                   env=engine_env(), check=True, capture_output=True, timeout=300)   # idle, cached: every side's q*
    started, runs = datetime.now(timezone.utc).isoformat(timespec="seconds"), []
    for r in range(args.rounds):
        for cond in args.conditions:
            for side in (args.sides if r % 2 == 0 else args.sides[::-1]):
                hogs = start_hogs(cond, args.hogs)
                try:
                    res = run_side(args, side)
                finally:
                    stop_hogs(hogs)
                rate = statistics.median(res["rates"][1:])
                runs.append({"round": r, "condition": cond, "side": side, "decode_tok_s": rate, **res})
                print(f"round {r} {cond:9} {side:10} {rate:7.1f} tok/s  fill fraction {res['fill_fractions'][-1]:.3f}"
                      f"  {res['follower']}", flush=True)
                time.sleep(1.0)
        save(args, started, runs)                   # every round: a run cut short keeps its rounds


def save(args, started: str, runs: list[dict]) -> None:
    conds, sides = args.conditions, args.sides

    def median(side, cond, key):
        return statistics.median(x[key] if key == "decode_tok_s" else x[key][-1] for x in runs
                                 if x["side"] == side and x["condition"] == cond)

    med = {s: {c: median(s, c, "decode_tok_s") for c in conds} for s in sides}
    frac = {s: {c: median(s, c, "fill_fractions") for c in conds} for s in sides}
    print(f"\n{'side':10} " + " ".join(f"{c:>10}" for c in conds) + "   fill fraction (" + " / ".join(conds) + ")")
    for s in sides:
        print(f"{s:10} " + " ".join(f"{med[s][c]:10.1f}" for c in conds) + "   "
              + " / ".join(f"{frac[s][c]:.3f}" for c in conds))
    ratio = {s: {c: med[s][c] / med[CALIBRATED][c] for c in conds} for s in sides} if CALIBRATED in sides else {}
    for s, rs in ratio.items():
        print(f"{s} / {CALIBRATED}: " + "  ".join(f"{c} {v:.2f}x" for c, v in rs.items()))
    result = {"benchmark": "contention_follow", "label": args.label, "hardware": describe(),
              "model": args.checkpoint, "cache_experts": args.cache_experts, "hogs": args.hogs,
              "requests": args.requests, "tokens": args.tokens, "started": started, "method": __doc__,
              "rounds_done": 1 + max(x["round"] for x in runs), "runs": runs, "medians_tok_s": med,
              "sides": sides, "conditions": conds, "fill_fraction": frac, "over_calibrated": ratio}
    entries = json.loads(args.out.read_text()) if args.out.exists() else {}
    entries[args.label] = result
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(entries, indent=1))
    plot(med, args.out.with_name(f"contention_follow_{args.label}.png"), args.label, conds,
         "GPU decode by split: the engine's, the calibrated one, fixed ones")


if __name__ == "__main__":
    main()
