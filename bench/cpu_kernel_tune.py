"""Tuning sweep of the CPU expert kernel: settings of its knobs side by side, in one process.

The same bank and calls as bench/cpu_expert_kernel.py (Qwen3-30B-A3B expert shape, bf16, a bank
at least 8x the last-level cache, each call on experts not read since long). Every round runs
every setting (``cpu_experts.tune`` knobs, see kernels/cpu/tune.h) on every case, with the
all-CPU STREAM-style read just before and after each setting, so each figure is also a paired
fraction of the read. Each case runs twice: called from Python (``experts_forward``, one call at a
time) and from C (``calls_seconds``: the same calls back to back in C, as the engine's CPU branch
and the calibration's B_cpu call the kernel; ``.../c`` keys). For every case it also reports where
a call's time goes (the kernel's own clock, ``cpu_experts.last_timing``): grouping, the last
participant's start, the end of the stage-1 chunks, the end; and the Python call around it.
A setting may also name ``threads=N`` (kernel participants, the caller included), e.g.
``"default; threads=16"`` on the 16-CPU GPU host, whose default leaves one CPU to the engine.

    python bench/cpu_kernel_tune.py --label h200-host-16core \\
        --settings "default; chunks_per_thread=8; amx_next=1,amx_pf=0" [--rounds 2] [--out DIR]

Writes DIR/cpu_kernel_tune.json (this machine's entry merged with the others') and a PNG.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from cpu_expert_kernel import RESULTS, H, I, bank_tensor, gbps, hardware, make_plans, write_results
from freetoken_engine.kernels import cpu_experts as ce

CASES = (("1_expert", 1), ("2_experts", 1), ("one_token", 1), ("random_top8", 4),
         ("same_experts", 4), ("same_experts", 6), ("same_experts", 8))


def parse_settings(text: str) -> list[tuple[str, dict]]:
    """"default; a=1,b=2; ..." -> [(label, knobs)]; raises ValueError naming a bad item."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        knobs = {}
        if item != "default":
            for kv in item.split(","):
                name, _, value = kv.partition("=")
                if name.strip() not in (*ce.TUNING_KNOBS, "threads") or not value.strip().isdigit():
                    raise ValueError(f"bad setting {kv!r}: want knob=int, knobs {', '.join(ce.TUNING_KNOBS)}, threads")
                knobs[name.strip()] = int(value)
        out.append((item, knobs))
    return out


def call_phases(x, w13, w2, plans, n: int) -> dict:
    """Median microseconds of n calls of a case: the kernel's phases and the Python call."""
    rows = []
    for i in range(n):
        tok, exp, _ = plans[i % len(plans)]
        t0 = time.perf_counter()
        ce.experts_forward(x, w13, w2, tok, exp)
        wall = 1e6 * (time.perf_counter() - t0)
        rows.append({**ce.last_timing(), "python_call": wall})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def c_gbps(x, w13, w2, plans, min_s: float, ebytes: int) -> float:
    """Weights' GB/s of the plans' calls run back to back from C (whole passes, >= min_s)."""
    exps = torch.stack([exp for _, exp, _ in plans])
    nbytes, secs = sum(d for *_, d in plans) * ebytes, 0.0
    ce.calls_seconds(x, w13, w2, plans[0][0], exps[:1])      # wake the pool
    n = 0
    while n == 0 or secs < min_s:
        secs += ce.calls_seconds(x, w13, w2, plans[0][0], exps)
        n += 1
    return n * nbytes / secs / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="this-machine")
    ap.add_argument("--settings", default="default")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: the kernel's default)")
    ap.add_argument("--seconds", type=float, default=0.2, help="per case and setting")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--min-read", type=float, default=0.0, metavar="GBPS",
                    help="drop a setting's round whose paired read fell below this and run it again (at most "
                         "4 tries each): the 2-CPU VM's memory flips between a ~75 and a ~45 GB/s state, and "
                         "in the slow one every case is memory-bound")
    args = ap.parse_args()
    settings = parse_settings(args.settings)

    hw = hardware()
    ncpu, ebytes = hw["cpus"], 3 * H * I * 2
    llc = hw["llc_bytes"] or 32 << 20
    E = max(6 * 128, -(-8 * llc // ebytes))
    E = min(E, int(0.4 * hw["ram_bytes"] // ebytes)) // 128 * 128
    w13, w2 = bank_tensor(E, 2 * I, H), bank_tensor(E, H, I)
    threads = args.threads or ce.default_threads()
    base = ce.tune()
    print(f"{hw['cpu_model']} | {ncpu} CPUs | {ce.backend_name()} | {threads} threads | bank {E} experts | "
          f"defaults {base}")
    gen = torch.Generator().manual_seed(0)
    plans = {c: make_plans(E, c[1], c[0], gen) for c in CASES}
    xs = {T: torch.randn(T, H).to(torch.bfloat16) for T in {c[1] for c in CASES}}
    samples: dict[str, dict[str, list[float]]] = {}
    phases: dict[str, list[dict]] = {}

    def read_all() -> float:
        ce.configure(threads=ncpu)
        v = w13.numel() * 2 / ce.read_seconds(w13) / 1e9
        ce.configure(threads=current[0])
        return v

    current = [threads]                      # the setting's kernel threads

    def measure() -> tuple[float, dict, dict]:
        """One setting's round: every case from Python and from C, the phases, and the all-CPU
        read around them (their mean)."""
        before = read_all()
        got = {f"{m}/T={T}": gbps(ce.experts_forward, xs[T], w13, w2, plans[(m, T)], args.seconds, ebytes)
               for m, T in CASES}
        got.update({f"{m}/T={T}/c": c_gbps(xs[T], w13, w2, plans[(m, T)], args.seconds, ebytes) for m, T in CASES})
        ph = {f"{m}/T={T}": call_phases(xs[T], w13, w2, plans[(m, T)], 100) for m, T in CASES}
        return 0.5 * (before + read_all()), got, ph

    dropped: dict[str, int] = {}
    for r in range(args.rounds):
        for label, knobs in settings:
            current[0] = knobs.get("threads", threads)
            ce.configure(threads=current[0])
            ce.tune(**{**base, **{k: v for k, v in knobs.items() if k != "threads"}})
            for _ in range(4):
                read, got, ph = measure()
                if read >= args.min_read:
                    break
                dropped[label] = dropped.get(label, 0) + 1
                print(f"  {label}: paired read {read:.1f} GB/s below --min-read, measured again")
            else:
                sys.exit(f"{label}: the paired read stayed below --min-read {args.min_read} GB/s")
            phases.setdefault(label, []).append(ph)
            s = samples.setdefault(label, {})
            for k, v in got.items():
                s.setdefault(k, []).append(v)
                s.setdefault(k + "/of_read", []).append(v / read)
            s.setdefault("read", []).append(read)
        print(f"round {r + 1}/{args.rounds} done")
    ce.tune(**base)
    ce.configure(threads=threads)

    table = {label: {k: statistics.median(v) for k, v in s.items()} for label, s in samples.items()}
    for label, ph in phases.items():
        table[label]["phases_us"] = {case: {k: statistics.median(p[case][k] for p in ph) for k in ph[0][case]}
                                     for case in ph[0]}
    cols = [f"{m}/T={T}" for m, T in CASES]
    print(f"\n{'setting':28s} {'driver':6s} " + " ".join(f"{c:>18s}" for c in cols) + "   (GB/s, % of paired read)")
    for label, t in table.items():
        for drv, suffix in (("python", ""), ("C", "/c")):
            print(f"{label:28s} {drv:6s} " + " ".join(f"{t[c + suffix]:9.1f} ({100 * t[c + suffix + '/of_read']:3.0f}%)"
                                                      for c in cols))
    print(f"\ncall phases, median us: {'setting':28s} {'case':16s} posted last_start stage1_end end python_call")
    for label, t in table.items():
        for case, p in t["phases_us"].items():
            print(f"{'':24s}{label:28s} {case:16s} " + " ".join(f"{p[k]:8.1f}" for k in p))

    out = args.out / "cpu_kernel_tune.json"
    data = json.loads(out.read_text()) if out.exists() else {"benchmark": "cpu_kernel_tune", "machines": {}}
    data["method"] = __doc__.strip().split("\n\n")[1]
    data["machines"][args.label] = {
        "hardware": hw, "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "kernel_backend": ce.backend_name(), "threads": threads, "defaults": base, "rounds": args.rounds,
        "min_read_gbps": args.min_read, "dropped_rounds": dropped, "medians": table}
    write_results(out, data, plot)


def plot(data: dict, path: Path) -> None:
    """One panel per machine: paired % of read per case, one bar per setting (driven from Python),
    a black tick on it where the same case driven from C was measured too."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    machines = data["machines"]
    fig, axes = plt.subplots(len(machines), 1, figsize=(11, 4 * len(machines)), squeeze=False)
    cols = [f"{m}/T={T}" for m, T in CASES]
    for ax, (label, m) in zip(axes[:, 0], machines.items()):
        table = m["medians"]
        w = 0.8 / max(1, len(table))
        for i, (setting, t) in enumerate(table.items()):
            xs = [j + i * w for j in range(len(cols))]
            ax.bar(xs, [100 * t.get(c + "/of_read", 0.0) for c in cols], w,
                   label=setting)                     # 0: a case that machine's sweep did not have
            c_runs = [(x, 100 * t[c + "/c/of_read"]) for x, c in zip(xs, cols) if c + "/c/of_read" in t]
            if c_runs:
                ax.scatter(*zip(*c_runs), marker="_", s=200, color="k", zorder=3,
                           label="driven from C" if i == 0 else None)
        ax.axhline(75, color="g", ls=":", label="75% of read")
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(cols))], cols, fontsize=7)
        ax.set_ylabel("% of all-CPU read (paired)")
        ax.set_title(f"{label}: {m['hardware']['cpu_model']}, {m['threads']} threads ({m['kernel_backend']})", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
