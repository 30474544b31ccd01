"""A/B of two versions of the CPU expert kernel: this working tree against a git revision.

A kernel's speed on a shared VM drifts by tens of percent within minutes, and two libraries
cannot be compared with knobs (they differ in code, not settings). So each side runs
``bench/cpu_kernel_tune.py`` (default settings, one round: every case of issue 8, the all-CPU
read measured around it) in its own process, alternating old, new, old, new, ... ``--pairs``
times; the old side from a temporary ``git worktree`` of ``--old`` (its library is built from its
own sources). Reported per pair and case: GB/s, the paired fraction of the read, and the case's
rate over the one-token rate of the same process (a ratio the machine's memory state moves
least). Quote a pair only when both of its sides saw the same memory state (their reads agree).

    python bench/cpu_kernel_ab.py --old REV --pairs 3 --label cpu-2core
    python bench/cpu_kernel_ab.py --old-tree DIR --old REV ...   # where git is absent (the GPU
        machine): DIR holds the old side's engine/ and bench/ (git archive REV engine bench)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from old_tree import old_tree

ROOT = Path(__file__).resolve().parent.parent
CASES = ("1_expert/T=1", "2_experts/T=1", "one_token/T=1", "random_top8/T=4", "same_experts/T=4",
         "same_experts/T=6", "same_experts/T=8")


def run_side(root: Path, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root / "engine"))
    cmd = [sys.executable, str(root / "bench/cpu_kernel_tune.py"), "--label", "ab", "--settings", "default",
           "--rounds", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=root / "bench", env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{root}: cpu_kernel_tune failed:\n{proc.stderr[-2000:]}")
    return json.loads((out / "cpu_kernel_tune.json").read_text())["machines"]["ab"]["medians"]["default"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="git revision of the old side")
    ap.add_argument("--old-tree", type=Path, default=None,
                    help="a folder with the old side's engine/ and bench/ instead of a git worktree of --old")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--label", default="this-machine")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu_kernel_ab.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    runs = []
    with old_tree(args.old, args.old_tree) as old_root:
        for i in range(args.pairs):
            for side, root in (("old", old_root), ("new", ROOT)):
                m = run_side(root, work / f"{side}{i}")
                row = {"pair": i, "side": side}
                for c in CASES:
                    row[c] = {"gbps": m[c], "of_read": m[c + "/of_read"], "of_one_token": m[c] / m["one_token/T=1"]}
                row["read_gbps"] = m["read"]
                runs.append(row)
                print(f"pair {i} {side:3} read {m['read']:5.1f} | " + " ".join(
                    f"{c.split('/')[0][:12]}/{c.split('=')[1]} {row[c]['gbps']:5.1f} ({row[c]['of_read']:4.0%})"
                    for c in CASES), flush=True)
    summary = {}
    for c in CASES:
        med = {side: {k: statistics.median(r[c][k] for r in runs if r["side"] == side)
                      for k in ("gbps", "of_read", "of_one_token")} for side in ("old", "new")}
        summary[c] = {**med, "new_over_old_gbps_per_pair": [
            next(r for r in runs if r["pair"] == i and r["side"] == "new")[c]["gbps"]
            / next(r for r in runs if r["pair"] == i and r["side"] == "old")[c]["gbps"] for i in range(args.pairs)]}
    print(f"{'case':20} {'old GB/s':>9} {'new GB/s':>9} {'old/read':>9} {'new/read':>9} {'old/1tok':>9} {'new/1tok':>9}")
    for c, v in summary.items():
        print(f"{c:20} {v['old']['gbps']:9.1f} {v['new']['gbps']:9.1f} {v['old']['of_read']:9.0%} "
              f"{v['new']['of_read']:9.0%} {v['old']['of_one_token']:9.2f} {v['new']['of_one_token']:9.2f}")
    from cpu_expert_kernel import hardware
    result = {"benchmark": "cpu_kernel_ab", "hardware": hardware(), "label": args.label, "old": args.old,
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "method": __doc__,
              "runs": runs, "medians": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(summary, args.out.with_suffix(".png"), args.label)


def plot(summary: dict, path: Path, label: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4))
    xs = range(len(summary))
    for i, side in enumerate(("old", "new")):
        ax.bar([x + 0.4 * (i - 0.5) for x in xs], [v[side]["of_read"] for v in summary.values()], 0.4, label=side)
    ax.axhline(0.75, color="k", lw=0.8, ls="--")
    ax.set_xticks(list(xs), [c.replace("/", "\n") for c in summary], fontsize=8)
    ax.set_ylabel("kernel / all-CPU read (median of pairs)")
    ax.set_title(f"CPU expert kernel A/B, {label} (dashed: issue 8's 75%)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
