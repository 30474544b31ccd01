"""The engine's CPU decode while another process keeps CPUs busy: this tree against a revision.

A gaming PC runs the engine next to a game, a browser or a build. The question is how much of
its speed the engine keeps when some of its CPUs are taken. Each side runs the README's main job
(``freetoken generate`` on the embedded default model, or ``--model DIR``) in a fresh process and
reads the decode tokens/s from its ``--json`` stats; every side runs in every condition, the
sides alternating within each round:

* conditions: ``idle``; ``busy-last`` (``--hogs`` busy-looping processes pinned to the last CPUs,
  where the kernel's pinned workers sit); ``busy-free`` (the same processes, not pinned: the
  scheduler places them, as it would a game's threads);
* sides: ``before`` (a ``git worktree`` of ``--old``, or ``--old-tree DIR`` holding its
  ``engine/``), ``after`` (this tree), and each with ``FREETOKEN_CPU_EXPERT_THREADS=1`` (the
  workaround a user had: one kernel thread).

Prints a table of median tokens/s per side and condition, and each side's busy / idle ratio;
writes JSON (hardware named) and a PNG.

    python bench/cpu_contention.py --old REV [--rounds 3] [--tokens 64] [--hogs 1] [--label cpu-2core]
        [--checkpoint qwen3moe-bf16] [--generate-args "--device cuda --expert-cache-experts 256
        --cpu-expert-fraction 0.5"] [--old-tree DIR]   # DIR where git is absent: git archive REV engine
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
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import describe  # noqa: E402
from old_tree import old_tree  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a short poem about the sea."
CONDITIONS = ("idle", "busy-last", "busy-free")
HOG = "import os, sys\nif sys.argv[1] != '-': os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass\n"


def start_hogs(condition: str, n: int) -> list[subprocess.Popen]:
    if condition == "idle":
        return []
    cpus = sorted(os.sched_getaffinity(0))
    where = [str(c) for c in cpus[-n:]] if condition == "busy-last" else ["-"] * n
    hogs = [subprocess.Popen([sys.executable, "-c", HOG, w]) for w in where]
    time.sleep(0.5)
    return hogs


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for h in hogs:
        h.kill()
        h.wait()


def decode_rate(root: Path, model: str | None, tokens: int, one_thread: bool, extra: list[str]) -> float:
    path = [str(root / "engine")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                     if p and not p.endswith("engine")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    if one_thread:
        env["FREETOKEN_CPU_EXPERT_THREADS"] = "1"
    cmd = [sys.executable, "-m", "freetoken_engine.cli", "generate", "--prompt", PROMPT,
           "--max-new-tokens", str(tokens), "--json"] + (["--model", model] if model else []) + extra
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        sys.exit(f"{root}: generate failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["stats"]["decode_tokens_per_s"]


def write_checkpoint(name: str) -> Path:
    """bench/cpu_generate.py's random checkpoint ``name``, written to a temporary folder."""
    import torch
    from cpu_generate import CHECKPOINTS
    from tiny_models import make_tiny_checkpoint
    spec = CHECKPOINTS[name]
    torch.set_default_dtype(getattr(torch, spec["dtype"]))
    try:
        return make_tiny_checkpoint(Path(tempfile.mkdtemp()), "qwen3_moe", vocab_size=spec["vocab_size"],
                                    dtype=spec["dtype"], **spec["shape"])
    finally:
        torch.set_default_dtype(torch.float32)


def plot(medians: dict, path: Path, label: str, conditions=CONDITIONS,
         title: str = "engine CPU decode with other processes busy") -> None:
    """Bars of median decode tokens/s: one group per condition, one bar per side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sides = list(medians)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(sides)
    for i, side in enumerate(sides):
        vals = [medians[side][c] for c in conditions]
        bars = ax.bar([j + i * width for j in range(len(conditions))], vals, width, label=side)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([j + width * (len(sides) - 1) / 2 for j in range(len(conditions))], conditions)
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title(f"{title} ({label})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="git revision of the before side")
    ap.add_argument("--old-tree", type=Path, default=None, help="a folder with the before side's engine/")
    ap.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    ap.add_argument("--checkpoint", default=None, choices=("qwen3moe-bf16", "medium"),
                    help="instead: write this random checkpoint of bench/cpu_generate.py and run it")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hogs", type=int, default=1, help="busy processes in the busy conditions")
    ap.add_argument("--generate-args", default="",
                    help="more arguments for freetoken generate, e.g. \"--device cuda --expert-cache-experts 40 "
                         "--cpu-expert-fraction 0.5\" (a GPU decode whose misses the CPU branch computes)")
    ap.add_argument("--no-one-thread", dest="one_thread", action="store_false",
                    help="leave out the sides with one kernel thread")
    ap.add_argument("--label", default="this-machine")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu_contention.json")
    args = ap.parse_args()
    if args.checkpoint:
        args.model = str(write_checkpoint(args.checkpoint))
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with old_tree(args.old, args.old_tree) as old_root:
        sides = {"before": (old_root, False), "after": (ROOT, False),
                 "before, 1 kernel thread": (old_root, True), "after, 1 kernel thread": (ROOT, True)}
        sides = {k: (root, one) for k, (root, one) in sides.items() if args.one_thread or not one}
        runs = []
        for r in range(args.rounds):
            for cond in CONDITIONS:
                hogs = start_hogs(cond, args.hogs)
                try:
                    for side, (root, one) in sides.items():
                        rate = decode_rate(root, args.model, args.tokens, one, args.generate_args.split())
                        runs.append({"round": r, "condition": cond, "side": side, "decode_tok_s": rate})
                        print(f"round {r} {cond:9} {side:24} {rate:7.1f} tok/s", flush=True)
                finally:
                    stop_hogs(hogs)
            save(args, started, list(sides), runs)         # every round: a run cut short keeps its rounds


def save(args, started: str, sides: list[str], runs: list[dict]) -> None:
    """Medians per side and condition printed, written to the JSON (this label's entry) and plotted."""
    medians = {side: {c: statistics.median(x["decode_tok_s"] for x in runs if x["side"] == side
                                           and x["condition"] == c) for c in CONDITIONS} for side in sides}
    print(f"\n{'side':24} " + " ".join(f"{c:>10}" for c in CONDITIONS) + "   busy-last/idle busy-free/idle")
    for side, m in medians.items():
        print(f"{side:24} " + " ".join(f"{m[c]:10.1f}" for c in CONDITIONS)
              + f"   {m['busy-last'] / m['idle']:14.2f} {m['busy-free'] / m['idle']:14.2f}")
    result = {"benchmark": "cpu_contention", "label": args.label, "hardware": describe(), "old": args.old,
              "model": args.checkpoint or args.model or "embedded default model", "tokens": args.tokens,
              "hogs": args.hogs, "generate_args": args.generate_args, "started": started, "method": __doc__,
              "rounds_done": 1 + max(x["round"] for x in runs), "runs": runs, "medians_tok_s": medians,
              "after_over_before": {c: medians["after"][c] / medians["before"][c] for c in CONDITIONS}}
    entries = json.loads(args.out.read_text()) if args.out.exists() else {}
    entries[args.label] = result
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(entries, indent=1))
    plot(medians, args.out.with_name(f"cpu_contention_{args.label}.png"), args.label)


if __name__ == "__main__":
    main()
