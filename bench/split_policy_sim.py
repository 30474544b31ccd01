"""Which misses take the q* fills: simulated miss rates and decode time on the GPU bench's routing.

The q* rule (``kernels/split.py``) decides how many of a layer call's m misses cross PCIe; the
rest are computed on the CPU and not cached. Which ones cross used to be the lowest expert ids.
An expert that the next token routes to again then misses again, and with one miss in a call
(q = 0 whenever the CPU is faster than PCIe) it is never cached at all. This simulation replays
the GPU benchmark's routing (``bench/offload_workload.py``: the locality model fitted to the
default model, and uniform) against the engine's pool (global LRU, fill admission with a window
of one step, 8 bypass slots) for these rules:

* ``ascending``: the q fills go to the lowest ids (the engine before 2026-11-30);
* ``recurring-first``: the same q, but misses routed in this layer during the last step come
  first (the engine now: ``cache/experts.py``, ``kernels/triton/control.py``);
* ``recurring-single``: recurring-first, and a call's single miss is filled when it recurs
  (beyond q*);
* ``recurring-all``: recurring-first, and every recurring miss is filled (q = max(q*, recurring)).
* ``fill-behind``: recurring-first, and PCIe's idle time in each call (its time less its fills')
  goes to copying, a slice a call, one of the misses the CPU computed into the cache (the newest
  when the copy starts; admissible victims only). The slices fit the calls' idle PCIe time, so
  the calls' times are recurring-first's, and an expert counts as cached once its last slice is
  in (its victim taken then). Built since stop 70 (``freetoken_engine/kernels/triton/behind.py``,
  opt-in ``FREETOKEN_FILL_BEHIND``, the GPU bench's ``lru+q*/behind``; docs/gpu.md).

Time model per layer call: max(fills x expert bytes / B_pcie, CPU experts x expert bytes /
B_cpu), the two sides at the rates measured beside each other on the H200 (run P: 48.5 and
88 GB/s by default), or a gpu_offload.py run's (``--rates-from``: each model's rates and its CPU
call-size curve, which then divides the CPU side and picks q as the engine does); the hits' GPU
time is left out (on a side stream beside the fills). The
first ``--warm`` tokens fill the cache and are not counted. Output: a table, JSON and a PNG.

    python bench/split_policy_sim.py [--tokens 128] [--bpcie 48.5] [--bcpu 88 | --rates-from RUN.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_policy_sim import cache_slots, steps, write_results  # noqa: E402
from hardware import describe  # noqa: E402
from offload_workload import MODELS, ROOT, make_routing, routing_params  # noqa: E402

from freetoken_engine.kernels.split import fills_for  # noqa: E402

RULES = ("ascending", "recurring-first", "recurring-single", "recurring-all", "fill-behind")
BYPASS = 8


def simulate(seq, slots: int, layers: int, f: float, t_fill: float, t_cpu: float, rule: str,
             counted_from: int, speed: tuple[float, ...] | None = None) -> dict:
    """Replay ``seq`` (one (layer, sorted experts) per call) under ``rule``; counts and time of the
    calls from index ``counted_from`` on."""
    resident: dict = {}        # (layer, expert) -> the call of its last use
    last_seen: dict = {}       # (layer, expert) -> the call that last routed it
    out = {"accesses": 0, "misses": 0, "fills": 0, "cpu": 0, "behind": 0, "seconds": 0.0}
    # fill-behind: PCIe idle seconds spent on the copy under way, its expert, the candidates
    credit, pending, computed = 0.0, None, []
    for i, (layer, active) in enumerate(seq):
        keys = [(layer, e) for e in active]
        hits = [k for k in keys if k in resident]
        for k in hits:
            resident[k] = i
        miss = [k for k in keys if k not in resident]
        recurring = [k for k in miss if i - last_seen.get(k, -layers - 1) <= layers] if rule != "ascending" else []
        target = fills_for(len(miss), f, speed=speed)
        if rule == "recurring-all" or (rule == "recurring-single" and len(miss) == 1):
            target = max(target, len(recurring))
        idle = sorted((v, k) for k, v in resident.items() if i - v > layers)     # admissible victims
        q = max(min(target, slots - len(hits), slots - len(resident) + len(idle)), 0)
        passing = min(target - q, BYPASS)
        order = recurring + [k for k in miss if k not in recurring]
        for k in order[:q]:
            if len(resident) >= slots:
                del resident[idle.pop(0)[1]]
            resident[k] = i
        cpu = len(miss) - q - passing
        cpu_s = cpu * t_cpu / (speed[min(cpu, len(speed)) - 1] if speed and cpu else 1.0)
        behind = 0
        if rule == "fill-behind":            # PCIe's idle time in this call, then whole copies from it
            credit += max(cpu_s - (q + passing) * t_fill, 0.0)
            computed.extend(order[q + passing:][::-1])          # the newest last, recurring ones newest
            del computed[:-4 * layers]                         # only the last few steps' misses
            while True:
                while pending is None and computed:            # the copy's expert is chosen as it starts
                    k = computed.pop()
                    pending = None if k in resident else k
                if pending is None or credit < t_fill:
                    break
                if pending not in resident:                    # else a fill took it meanwhile: wasted
                    if len(resident) >= slots:
                        if not idle:
                            break
                        del resident[idle.pop(0)[1]]
                    resident[pending] = i
                    behind += 1
                credit -= t_fill
                pending = None
        for k in keys:
            last_seen[k] = i
        if i >= counted_from:
            out["accesses"] += len(keys)
            out["misses"] += len(miss)
            out["fills"] += q + passing
            out["cpu"] += cpu
            out["behind"] += behind
            out["seconds"] += max((q + passing) * t_fill, cpu_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens counted (after --warm)")
    ap.add_argument("--warm", type=int, default=64)
    ap.add_argument("--budgets", default="16,32")
    ap.add_argument("--bpcie", type=float, default=48.5, help="GB/s")
    ap.add_argument("--bcpu", type=float, default=88.0, help="GB/s")
    ap.add_argument("--rates-from", type=Path, default=None,
                    help="a gpu_offload.py result: each model's B_pcie and B_cpu (1-fill launches beside 1-expert "
                         "C calls) and its CPU call-size curve, as that run's lru+q* split them (else --bpcie/--bcpu, "
                         "no curve)")
    ap.add_argument("--routings", default="locality,uniform")
    ap.add_argument("--rules", default=",".join(RULES), help="the first is the base of the speed-ups")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "split_policy_sim.json")
    args = ap.parse_args()
    measured = json.loads(args.rates_from.read_text())["bandwidth"] if args.rates_from else {}
    rows, rates = [], {}
    rules = args.rules.split(",")
    if not set(rules) <= set(RULES):
        ap.error(f"--rules: choose from {', '.join(RULES)}")
    print(f"{'model':<17}{'routing':<10}{'batch':>5}{'card':>5}  " + "".join(f"{r:>24}" for r in rules))
    for name, model in MODELS.items():
        params = routing_params(ROOT, model)
        layers, size = model["layers"], model["expert_bytes"]
        bw = measured.get(name)
        bp, bc = (args.bpcie, args.bcpu) if not bw else (bw["concurrent_gather_fill_gbps_1_fill_per_launch"],
                                                          bw["concurrent_cpu_expert_gbps_beside_1_fill_launches"])
        speed = tuple(bw["cpu_call_speed"]) if bw and bw.get("cpu_call_speed") else None
        f, t_fill, t_cpu = bp / (bp + bc), size / (bp * 1e9), size / (bc * 1e9)
        rates[name] = {"pcie_gbps": bp, "cpu_gbps": bc, "fill_fraction": f, "cpu_call_speed": speed}
        for kind in args.routings.split(","):
            for batch in (1, 4):
                seq = steps(make_routing(model, args.warm + args.tokens, batch, kind, params, seed=1))
                for card in (float(b) for b in args.budgets.split(",")):
                    slots = cache_slots(card, model) - BYPASS
                    res = {rule: simulate(seq, slots, layers, f, t_fill, t_cpu, rule, args.warm * layers, speed)
                           for rule in rules}
                    base = res[rules[0]]["seconds"]
                    for r in res.values():
                        r["miss_rate"] = r["misses"] / r["accesses"]
                        r["ms_per_token"] = 1e3 * r["seconds"] / args.tokens
                        r["speedup_vs_base"] = base / r["seconds"] if r["seconds"] else 1.0
                    rows.append({"model": name, "routing": kind, "batch": batch, "card_gib": card,
                                 "lru_slots": slots, "rules": res})
                    print(f"{name:<17}{kind:<10}{batch:>5}{card:>5.0f}  " + "".join(
                        f"{r['miss_rate']:>9.3f} {r['ms_per_token']:6.2f}ms {r['speedup_vs_base']:5.2f}x"
                        for r in res.values()))
    result = {"benchmark": "split_policy_sim", "hardware": describe(), "rates": rates,
              "rates_from": str(args.rates_from) if args.rates_from else None, "tokens": args.tokens,
              "warm_tokens": args.warm, "method": __doc__.strip().split("\n\n")[1], "rows": rows}
    write_results(result, args.out, plot)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    rules = list(rows[0]["rules"])                  # the first is the base
    width = 0.8 / len(rules)
    for j, rule in enumerate(rules):
        ax.bar([i + width * (j - (len(rules) - 1) / 2) for i in range(len(rows))],
               [r["rules"][rule]["speedup_vs_base"] for r in rows], width, label=rule)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(rows)), [f"{r['model'].split('-')[0]}\n{r['routing'][:3]} b{r['batch']}\n{r['card_gib']:.0f} GB"
                                     for r in rows], fontsize=7)
    ratios = [r["rules"][rule]["speedup_vs_base"] for r in rows for rule in rules]
    ax.set_ylim(min(0.85, min(ratios) - 0.02), max(1.15, max(ratios) + 0.02))
    ax.set_ylabel(f"simulated decode speed vs {rules[0]}")
    ax.set_title("which misses take the q* fills (simulated, GPU bench routing)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
