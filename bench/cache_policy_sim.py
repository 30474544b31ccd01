"""Expert-cache replacement policies on the GPU benchmark's routing: miss rates, simulated.

Why: on the H200 (bench/results/gpu_offload.json) the engine's global LRU missed *every* expert
at batch 4 on an 8 GB card (miss rate 1.00) although the routing has locality. One decode step
visits the layers in order; when a token's working set (layers x distinct experts per layer)
exceeds the cache, global LRU evicts each expert before the next token comes back to its layer,
the classic cyclic-scan failure. This simulation measures, on the same routing generator
(bench/offload_workload.py, fitted to the default model's routing statistics) and the same
cache sizes (card - non-expert weights - 1.5 GiB), how far other policies get:

* ``global-lru``: the engine's policy before fill admission (one pool, LRU victims, hits of the
  step never evicted);
* ``admission``: the engine's policy (cache/experts.py): global LRU, but a miss is filled only
  when its victim is empty or unused for more than one step (the layer count of calls), else it
  is computed on the CPU and not cached;
* ``layer-lru``: the pool less one call's worth of scratch slots split evenly between layers,
  LRU inside each layer's share (a call's extra experts stream through the scratch slots);
* ``belady``: the offline optimum for one global pool (evict the resident used furthest in the
  future): a bound, not a policy.

Every miss is filled (side (c) of the GPU benchmark) except where admission refuses it (then it
is computed on the CPU, as in side (d)); a policy's miss rate is hardware
independent, so this runs on any CPU. Output: a table, bench/results/cache_policy_sim.json
and a PNG.

    python bench/cache_policy_sim.py [--tokens 128]
"""
from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import OrderedDict, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import describe  # noqa: E402
from offload_workload import MODELS, ROOT, make_routing, routing_params  # noqa: E402

GiB = 1 << 30
RESULTS = ROOT / "bench" / "results"


def cache_slots(card_gib: float, model: dict) -> int:
    """The GPU benchmark's rule: VRAM - non-expert weights - 1.5 GiB, in whole experts."""
    return max(int((card_gib * GiB - model["non_expert_bytes"] - 1.5 * GiB) // model["expert_bytes"]), 1)


def steps(ids) -> list[tuple[int, list[int]]]:
    """The access sequence: one (layer, sorted distinct experts) per layer call, tokens in order."""
    n_tok, n_layers = ids.shape[:2]
    return [(l, sorted(set(ids[t, l].flatten().tolist()))) for t in range(n_tok) for l in range(n_layers)]


def lru_call(cache: OrderedDict, keys: list, slots: int | None = None) -> int:
    """One layer call on an LRU ``cache``: stamp the hits first (they are never victims), then
    fill the misses, evicting the least recently used while ``slots`` is reached. -> misses."""
    for key in keys:
        if key in cache:
            cache.move_to_end(key)
    misses = 0
    for key in keys:
        if key not in cache:
            misses += 1
            if slots is not None and len(cache) >= slots:
                cache.popitem(last=False)
            cache[key] = True
    return misses


def global_lru(seq, slots: int) -> tuple[int, int]:
    cache: OrderedDict = OrderedDict()
    misses = sum(lru_call(cache, [(layer, e) for e in active], slots) for layer, active in seq)
    return misses, sum(len(active) for _, active in seq)


def admission_lru(seq, slots: int, window: int) -> tuple[int, int]:
    """Global LRU whose fills need a victim idle for more than ``window`` calls (or an empty
    slot); refused misses are not cached."""
    cache: OrderedDict = OrderedDict()         # key -> the call index of its last use, LRU first
    misses = accesses = 0
    for i, (layer, active) in enumerate(seq):
        keys = [(layer, e) for e in active]
        for key in keys:                       # stamp the hits first: never victims
            if key in cache:
                cache[key] = i
                cache.move_to_end(key)
        for key in keys:
            accesses += 1
            if key in cache:
                continue
            misses += 1
            if len(cache) >= slots:
                if i - next(iter(cache.values())) <= window:
                    continue                   # the LRU victim was used within the last step
                cache.popitem(last=False)
            cache[key] = i
    return misses, accesses


def layer_lru(seq, slots: int, n_layers: int, scratch: int) -> tuple[int, int]:
    """Each layer keeps at most its share of ``slots - scratch`` experts between its calls; a
    call with more active experts than its share streams the extra ones through ``scratch``
    common slots (the largest call), so the pool never holds more than ``slots``."""
    kept = max(slots - scratch, 0)
    share = [kept // n_layers + (1 if l < kept % n_layers else 0) for l in range(n_layers)]
    caches = [OrderedDict() for _ in range(n_layers)]
    misses = 0
    for layer, active in seq:
        misses += lru_call(caches[layer], active)
        while len(caches[layer]) > share[layer]:      # keep the most recently used share
            caches[layer].popitem(last=False)
    return misses, sum(len(active) for _, active in seq)


def belady(seq, slots: int) -> tuple[int, int]:
    uses = defaultdict(list)
    for i, (layer, active) in enumerate(seq):
        for e in active:
            uses[(layer, e)].append(i)
    ptr = defaultdict(int)
    never = len(seq) + 1
    resident: dict = {}                        # key -> its next use (the heap's current entry)
    heap: list = []                            # (-next use, key), stale entries skipped
    misses = accesses = 0
    for i, (layer, active) in enumerate(seq):
        keys = [(layer, e) for e in active]
        for key in keys:                       # advance each key's next use past this step
            ptr[key] += 1
        for key in keys:
            accesses += 1
            nxt = uses[key][ptr[key]] if ptr[key] < len(uses[key]) else never
            if key not in resident:
                misses += 1
                spared = []                    # this step's experts are never victims
                while len(resident) >= slots:
                    neg, victim = heapq.heappop(heap)
                    if resident.get(victim) != -neg:
                        continue               # stale entry
                    if victim in keys:
                        spared.append((neg, victim))
                    else:
                        del resident[victim]
                for entry in spared:
                    heapq.heappush(heap, entry)
            resident[key] = nxt
            heapq.heappush(heap, (-nxt, key))
    return misses, accesses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--budgets", default="8,16,32")
    ap.add_argument("--out", type=Path, default=RESULTS / "cache_policy_sim.json")
    args = ap.parse_args()
    rows = []
    print(f"{'model':<16}{'routing':<10}{'batch':>6}{'card':>6}{'slots':>7}{'global-lru':>12}{'admission':>11}"
          f"{'layer-lru':>11}{'belady':>9}")
    for name, model in MODELS.items():
        params = routing_params(ROOT, model)
        for kind in ("locality", "uniform"):
            for batch in (1, 4):
                seq = steps(make_routing(model, args.tokens, batch, kind, params, seed=1))
                for card in (float(b) for b in args.budgets.split(",")):
                    slots = cache_slots(card, model)
                    rates = {}
                    scratch = model["top_k"] * batch           # the largest call's distinct experts
                    for policy, fn in (("global-lru", lambda: global_lru(seq, slots)),
                                       ("admission", lambda: admission_lru(seq, slots, model["layers"])),
                                       ("layer-lru", lambda: layer_lru(seq, slots, model["layers"], scratch)),
                                       ("belady", lambda: belady(seq, slots))):
                        m, a = fn()
                        rates[policy] = m / a
                    rows.append({"model": name, "routing": kind, "batch": batch, "card_gib": card,
                                 "slots": slots, "miss_rate": rates})
                    print(f"{name:<16}{kind:<10}{batch:>6}{card:>6.0f}{slots:>7}"
                          f"{rates['global-lru']:>12.3f}{rates['admission']:>11.3f}{rates['layer-lru']:>11.3f}"
                          f"{rates['belady']:>9.3f}")
    result = {"benchmark": "cache_policy_sim", "hardware": describe(), "tokens": args.tokens,
              "method": __doc__.strip().split("\n\n")[1], "rows": rows}
    write_results(result, args.out, plot)


def write_results(result: dict, out: Path, plot) -> None:
    """``result`` as JSON at ``out`` and ``plot(result["rows"], PNG path)`` beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result["rows"], out.with_suffix(".png"))
    print(f"wrote {out}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({(r["model"], r["routing"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(2, len(panels) // 2, figsize=(3.2 * len(panels) // 2, 6), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        sel = [r for r in rows if (r["model"], r["routing"], r["batch"]) == key]
        for policy, style in (("global-lru", "o-"), ("admission", "d-"), ("layer-lru", "s-"), ("belady", "^:")):
            ax.plot([r["card_gib"] for r in sel], [r["miss_rate"][policy] for r in sel], style, label=policy)
        ax.set_title(f"{key[0]}\n{key[1]}, batch {key[2]}", fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("card (GiB)", fontsize=7)
        ax.set_ylabel("miss rate", fontsize=7)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Expert-cache miss rate by replacement policy (simulated; every miss filled but where admission "
                 "refuses)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
