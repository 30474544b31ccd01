"""Merge decode runs of bench/gpu_offload.py into bench/results/gpu_offload.json.

A full decode run of both models does not fit in one 10-minute call on the GPU machine, so each
model runs in its own call (``gpu_offload.py --models M --no-prefill --out runM.json``) and this
script makes their rows the file's decode rows: the rows they replace move, with their bandwidths,
checks, control-step timings and targets, to ``decode_split_runs[<previous label>]``; the prefill rows
stay. A run with prefill rows (``gpu_offload.py --no-decode``) replaces the prefill rows instead:
the old ones move, with their target and hardware, to ``prefill_split_runs[<previous label>]``, the
run's hardware is kept as ``prefill_hardware``, and the prefill target is recomputed from its rows
(prefill_8k: each model's double-buffered 8k chunk within 10% of expert bytes / B_pcie). The
decode targets of the fast-path issue are recomputed from the decode rows:
  * decode_lru_q_fraction_of_bound (target 0.85) and ..._of_integer_split_bound, per row of (d);
  * decode_lru_q_vs_static_32gb (target 1.5) and the same ratio of the two bounds, (b) being the
    faster of the static drivers the run has (static, static/graph: decode_static_side_32gb);
  * decode_admission_vs_plain: (d) over (d) without fill admission (rows of lru+q*/plain);
  * decode_bypass_vs_nobypass: (d) over (d) without bypass slots (rows of lru+q*/nobypass);
  * decode_cpu_gbps_in_row: each (d) row's CPU expert rate inside the decode (CPU experts' bytes
    over the C++ branch's time in the kernel): the host's rate drifts during a run;
  * decode_speed_curve_vs_flat: (d) over (d) with q* from the 1-expert CPU rate for every call
    size (rows of lru+q*/flat), and the geometric mean over the rows;
  * decode_repeat_vs_first: (d) over (d) run once more after the A/B rows (rows of lru+q*/again:
    the same work), with its range: the noise an A/B ratio of that run must leave to mean anything;
  * decode_behind_over_lru_q: (d) with fills behind the CPU (rows of lru+q*/behind) over (d), with
    both miss rates and the behind row's fraction of its bound (its copied bytes count as misses),
    and the geometric mean over the rows;
  * decode_lru_q_fraction_of_gather_bound (a diagnostic, not the target): each (d) row against
    its bound with the fill gather's measured rate (1-fill launches beside the CPU) in place of
    B_pcie, the DMA's: what the row reaches of what its fill path can draw on that host.

    python bench/offload_merge.py --label N --previous G+H --note "..." runN_30b.json runN_36.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench/results/gpu_offload.json"
PER_MODEL = ("bandwidth", "checks", "control_step_us", "routing_locality")


def _key(r: dict) -> str:
    budget = "" if r["budget_gib"] is None else f" {r['budget_gib']:g}GB"
    return f"{r['model']} {r['routing']} b{r['batch']}{budget}"


def _geomean(values) -> float:
    values = list(values)
    return round(math.prod(values) ** (1 / len(values)), 3)


def targets(rows: list[dict]) -> dict:
    """The issue's decode targets from a run's rows (see the module docstring)."""
    by = {(_key(r), r["policy"]): r for r in rows if "error" not in r}
    q = {k: r for (k, p), r in by.items() if p == "lru+q*"}
    out = {"decode_lru_q_fraction_of_bound": {k: round(r["fraction_of_bound"], 3) for k, r in q.items()},
           "decode_lru_q_fraction_of_integer_split_bound":
               {k: round(r["fraction_of_integer_split_bound"], 3) for k, r in q.items()
                if "fraction_of_integer_split_bound" in r},
           "decode_lru_q_vs_static_32gb": {}, "decode_bound_ratio_lru_q_vs_static_32gb": {}, "decode_static_side_32gb": {},
           "decode_admission_vs_plain": {}, "decode_bypass_vs_nobypass": {}, "decode_cpu_gbps_in_row": {},
           "decode_speed_curve_vs_flat": {}, "decode_repeat_vs_first": {}, "decode_behind_over_lru_q": {}}
    for k, r in q.items():
        # (b): the faster of the two static drivers (the per-layer one and the one-graph handshake)
        s = max((by[(k, p)] for p in ("static", "static/graph") if (k, p) in by), key=lambda r: r["tok_s"], default=None)
        plain, nob = by.get((k, "lru+q*/plain")), by.get((k, "lru+q*/nobypass"))
        for name, side in (("decode_speed_curve_vs_flat", "lru+q*/flat"),
                           ("decode_repeat_vs_first", "lru+q*/again")):        # (d) over that side
            if (k, side) in by:
                out[name][k] = round(r["tok_s"] / by[(k, side)]["tok_s"], 3)
        if (k, "lru+q*/behind") in by:
            b = by[(k, "lru+q*/behind")]
            out["decode_behind_over_lru_q"][k] = {"tok_s": round(b["tok_s"] / r["tok_s"], 3),
                                                  "miss_rate": [round(b["miss_rate"], 3), round(r["miss_rate"], 3)],
                                                  "behind_fraction_of_bound": round(b["fraction_of_bound"], 3)}
        if nob:
            out["decode_bypass_vs_nobypass"][k] = {"tok_s": round(r["tok_s"] / nob["tok_s"], 2),
                                                   "cpu_experts_per_step": [round(r["cpu_experts_per_step"], 1),
                                                                            round(nob["cpu_experts_per_step"], 1)]}
        if r.get("cpu_gbps_in_row"):
            out["decode_cpu_gbps_in_row"][k] = round(r["cpu_gbps_in_row"], 1)
        if s and k.endswith(" 32GB"):
            out["decode_lru_q_vs_static_32gb"][k] = round(r["tok_s"] / s["tok_s"], 2)
            out["decode_bound_ratio_lru_q_vs_static_32gb"][k] = round(r["bound_tok_s"] / s["bound_tok_s"], 2)
            out["decode_static_side_32gb"][k] = s["policy"]
        if plain:
            out["decode_admission_vs_plain"][k] = {"tok_s": round(r["tok_s"] / plain["tok_s"], 2),
                                                   "miss_rate": [round(r["miss_rate"], 3), round(plain["miss_rate"], 3)]}
    out["decode_lru_q_fraction_of_gather_bound"] = {k: round(r["fraction_of_gather_bound"], 3) for k, r in q.items()
                                                    if "fraction_of_gather_bound" in r}
    fr = out["decode_lru_q_fraction_of_bound"]
    out["decode_rows_at_or_above_0.85"] = f"{sum(v >= 0.85 for v in fr.values())} of {len(fr)}"
    if out["decode_speed_curve_vs_flat"]:
        out["decode_speed_curve_vs_flat_geomean"] = _geomean(out["decode_speed_curve_vs_flat"].values())
    if out["decode_behind_over_lru_q"]:
        out["decode_behind_over_lru_q_geomean"] = _geomean(v["tok_s"] for v in out["decode_behind_over_lru_q"].values())
    if out["decode_repeat_vs_first"]:
        again = out["decode_repeat_vs_first"].values()
        out["decode_repeat_vs_first_range"] = [min(again), max(again)]
    vs = out["decode_lru_q_vs_static_32gb"]
    out["decode_32gb_rows_at_or_above_1.5x"] = f"{sum(v >= 1.5 for v in vs.values())} of {len(vs)}"
    return out


def prefill_target(rows: list[dict]) -> dict:
    """The issue's prefill target from a run's prefill rows: each model's double-buffered 8k chunk
    within 10% of its expert bytes over B_pcie."""
    at = {r["model"]: r for r in rows if r["tokens"] == 8192 and r["mode"] == "double" and "error" not in r}
    return {"target": "seconds per 8k chunk within 10% of expert bytes / B_pcie",
            "met": bool(at) and all(r["seconds"] <= 1.1 * r["bound_seconds"] for r in at.values()),
            "rows": {m: {"seconds": round(r["seconds"], 3), "bound_seconds": round(r["bound_seconds"], 3)}
                     for m, r in at.items()}}


def add_gather_bound(run: dict) -> None:
    """Give each (d) row of a run its bound at the fill gather's rate (see the module docstring):
    the row's bound time plus its missed bytes' extra time when they split between the gather and
    the CPU instead of the DMA and the CPU, from the row's counts and the run's bandwidths."""
    for r in run["decode"]:
        bw = run["bandwidth"].get(r["model"], {})
        gather = bw.get("concurrent_gather_fill_gbps_1_fill_per_launch")
        if not r["policy"].startswith("lru+q*") or "error" in r or not gather or not r.get("bound_tok_s"):
            continue
        bp, bc, se = bw["bound_pcie_gbps"] * 1e9, bw["bound_cpu_gbps"] * 1e9, bw["expert_bytes"]
        missed = (r["fills_per_step"] + r["cpu_experts_per_step"]) * se
        t = r["batch"] / r["bound_tok_s"] + missed * (1 / (min(gather * 1e9, bp) + bc) - 1 / (bp + bc))
        r["bound_at_gather_rate_tok_s"] = r["batch"] / t
        r["fraction_of_gather_bound"] = t / r["seconds_per_step"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="gpu_offload.py output JSONs (one per model)")
    ap.add_argument("--label", required=True, help="name of the new run (e.g. N)")
    ap.add_argument("--previous", required=True, help="name under which the replaced rows are kept")
    ap.add_argument("--note", required=True, help="what the run is: date, command, code")
    ap.add_argument("--result", type=Path, default=RESULT)
    args = ap.parse_args()
    data = json.loads(args.result.read_text())
    runs = [json.loads(p.read_text()) for p in args.runs]
    decode_runs = [run for run in runs if run["decode"]]
    prefill_runs = [run for run in runs if run.get("prefill")]
    if not decode_runs and not prefill_runs:
        sys.exit("offload_merge: the runs have no decode or prefill rows to merge")
    prefill = {k: v for k, v in (data.get("targets") or {}).items() if k == "prefill_8k"}  # a decode-only file has none
    if prefill_runs:            # a prefill run: its rows replace the file's, the old ones are kept
        data.setdefault("prefill_split_runs", {})[args.previous] = {
            "rows": data.get("prefill", []), "hardware": data.get("prefill_hardware", data.get("hardware")), **prefill}
        data["prefill"] = [{**r, "run": args.label} for run in prefill_runs for r in run["prefill"]]
        data["prefill_hardware"] = prefill_runs[0]["hardware"]
        prefill = {"prefill_8k": prefill_target(data["prefill"])}
    if decode_runs:
        for run in decode_runs:
            add_gather_bound(run)
        old = {"rows": data["decode"], **{k: data.get(k) for k in PER_MODEL}, "started": data.get("started"),
               "targets": data.get("targets")}
        data.setdefault("decode_split_runs", {})[args.previous] = old
        data["decode"] = [r for run in decode_runs for r in run["decode"]]
        for k in PER_MODEL:
            data[k] = {name: v for run in decode_runs for name, v in run.get(k, {}).items()}
        data["started"] = min(run["started"] for run in decode_runs)
        data["label"] = args.label                          # the file's decode rows are this run's now
        data["hardware"] = decode_runs[0]["hardware"]
        data["cpu_expert_features"], data["method"] = decode_runs[0]["cpu_expert_features"], decode_runs[0]["method"]
    data.setdefault("runs", {})[args.label] = args.note
    data["targets"] = {**targets(data["decode"]), **prefill}
    args.result.write_text(json.dumps(data, indent=1))
    from gpu_offload import plot
    plot(data, args.result.with_suffix(".png"))
    print(json.dumps({k: v for k, v in data["targets"].items() if k != "prefill_8k"}, indent=1))


if __name__ == "__main__":
    main()
