"""Prefill with part of the experts cached on the GPU: what crosses PCIe, and how fast.

A prefill chunk streams whole layers of experts (cache/prefetch.py). With an expert cache that
holds part of the model (a consumer card's budget), the cached experts need not cross PCIe.
Sides, every one in this process on the same bank, cache and routing (uniform: a prefill
chunk touches nearly every expert anyway), through the engine's own MoE path
(``OffloadedExperts.forward``, cache/offload.py):

- ``in place``: the engine's default. The cached experts are computed from the slot pool in place;
  the streamer's buffer brings only the others, over PCIe.
- ``gather``: ``OffloadedExperts.prefill_in_place = False`` (the engine before 2026-12-01). The
  streamer also copies the cached experts into its buffer, device to device, on the copy
  stream after the PCIe copies.
- ``... + seed``: the same in a prompt's last chunk, which also seeds the decode cache with the
  last token's experts after every layer (one host sync a layer; in place, the queued layer's
  buffer gets back any expert the seed evicted).
- ``no cache``: the streamer without a cache: every expert over PCIe (bench/gpu_offload.py's
  prefill row).
- ``compute``: the same MoE kernels on a layer already on the device, nothing copied: the floor.

Per pass: seconds, tokens/s, the bytes that crossed PCIe and the bound ``PCIe bytes / B_pcie``
(B_pcie: pinned host-to-device copies of whole layers, measured in the same run). Each side
runs one untimed pass first (kernels, the first seeds, allocations); rounds run the sides in
ABBA order; the report keeps each side's median. The in-place, gather and no-cache passes
should give the same hidden state bit for bit (checked: ``in_place_equals_gather``).

Usage: python bench/prefill_cached.py [--layers 48] [--budgets 16,32] [--tokens 8192]
       [--rounds 2] [--out bench/results/prefill_cached.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload_workload import CUDA, MODELS, ROOT, Bank  # noqa: E402
from offload_measure import combine  # noqa: E402
from gpu_offload import cache_slots as card_slots  # noqa: E402
from hardware import describe  # noqa: E402
from report import save  # noqa: E402
from freetoken_engine.cache.experts import ExpertCache  # noqa: E402
from freetoken_engine.cache.offload import OffloadedExperts  # noqa: E402
from freetoken_engine.cache.prefetch import LayerStreamer  # noqa: E402
from freetoken_engine.kernels.triton.moe import moe_slots_forward  # noqa: E402

SIDES = ("in place", "gather", "in place + seed", "gather + seed", "no cache", "compute")


def cache_slots(card_gib: float, model: dict, full_layers: int) -> int:
    """bench/gpu_offload.py's expert slots of a card for the whole model of ``full_layers``
    layers, scaled to the layers this run has (fewer than every expert)."""
    whole = card_slots(card_gib, model)
    return int(min(max(whole * model["layers"] // full_layers, 1), model["layers"] * model["experts"] - 1))


def pcie_gbps(bank: Bank, layers: int = 4) -> float:
    """Pinned host-to-device copies of whole layers, GB/s (1e9), best of three."""
    w13 = torch.empty(bank.w13.shape[1:], dtype=bank.w13.dtype, device=CUDA)
    w2 = torch.empty(bank.w2.shape[1:], dtype=bank.w2.dtype, device=CUDA)
    best = 0.0
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for layer in range(layers):
            w13.copy_(bank.w13[layer], non_blocking=True)
            w2.copy_(bank.w2[layer], non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, layers * (w13.nbytes + w2.nbytes) / (start.elapsed_time(end) / 1e3) / 1e9)
    return best


def fill_cache(bank: Bank, slots: int, seed: int) -> ExpertCache:
    """A cache of ``slots`` slots holding random experts, spread evenly over the layers (the
    residency a decode leaves behind, roughly); plain LRU, so the seed's victims are the oldest."""
    m = bank.model
    cache = ExpertCache(bank, slots, CUDA, fill_fraction=1.0, admit_window=0)
    g = torch.Generator().manual_seed(seed)
    per, extra = divmod(slots, m["layers"])
    for layer in range(m["layers"]):
        n = per + (layer < extra)
        cache.step(layer, torch.randperm(m["experts"], generator=g)[:n].to(CUDA))
    torch.cuda.synchronize()
    return cache


class Pass:
    """One prefill pass of ``tokens`` tokens over every MoE layer, uniform routing."""

    def __init__(self, bank: Bank, tokens: int):
        m = bank.model
        self.bank, self.tokens, self.k = bank, tokens, m["top_k"]
        g = torch.Generator(device=CUDA).manual_seed(tokens)
        self.ids = torch.stack([torch.rand(tokens, m["experts"], device=CUDA, generator=g).topk(self.k, dim=-1).indices
                                for _ in range(m["layers"])])                               # [L, T, k]
        self.x0 = torch.randn(tokens, m["hidden"], device=CUDA, generator=g).to(torch.bfloat16)
        self.tok = torch.arange(tokens, device=CUDA).repeat_interleave(self.k)

    def new_last_token(self, seed: int) -> None:
        """Route the pass's last token anew (what a prompt's last chunk seeds the cache with)."""
        m = self.bank.model
        g = torch.Generator(device=CUDA).manual_seed(1000 + seed)
        self.ids[:, -1] = torch.rand(self.ids.shape[0], m["experts"], device=CUDA, generator=g).topk(self.k, dim=-1).indices

    def run(self, rows_of, layers: int | None = None, tokens: int | None = None) -> torch.Tensor:
        """``rows_of(layer, x, ids [T, k]) -> [T*k, H]``; returns the last hidden state."""
        t = tokens or self.tokens
        x = self.x0[:t]
        for layer in range(layers or self.ids.shape[0]):
            x = combine(rows_of(layer, x, self.ids[layer, :t]), None, x, self.k)
        return x


def timed(fn) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    x = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, x


def budget_rows(bank: Bank, card: float, tokens: int, rounds: int, gbps: float,
                full_layers: int) -> tuple[list[dict], bool]:
    m = bank.model
    slots = cache_slots(card, m, full_layers)
    cache = fill_cache(bank, slots, seed=int(card))
    experts = OffloadedExperts(bank, cache, prefill_threshold=64, cpu_backend="reference", backend="triton",
                               top_k=m["top_k"])
    plain = LayerStreamer(bank, CUDA)
    work = Pass(bank, tokens)
    resident = (bank.w13[0].to(CUDA), bank.w2[0].to(CUDA))

    def engine(in_place: bool, seed: bool):
        def rows_of(layer, x, ids):
            experts.prefill_in_place, experts._seed, experts.seed_now = in_place, seed, seed
            return experts.forward(layer, x, ids)
        return rows_of

    def kernel(w):
        return lambda layer, x, ids: moe_slots_forward(x, *w(layer), work.tok[:ids.numel()], ids.reshape(-1))

    sides = {"in place": engine(True, False), "gather": engine(False, False),
             "in place + seed": engine(True, True), "gather + seed": engine(False, True),
             "no cache": kernel(plain.layer), "compute": kernel(lambda layer: resident)}
    for side, rows_of in sides.items():     # one untimed pass of each: kernels, first seeds, allocations
        if "seed" in side:
            work.new_last_token(100 + side.startswith("gather"))
        work.run(rows_of)
    streamers = {"no cache": plain}
    rows, same = [], None
    for rnd in range(rounds):
        order = list(SIDES) if rnd % 2 == 0 else list(reversed(SIDES))
        outs = {}
        for side in order:
            s = streamers.get(side, experts.streamer)
            pcie0, dev0, back0, seeded0 = s.pcie_bytes, s.device_bytes, getattr(s, "restored", 0), experts.seeded
            if "seed" in side:                # a new last token: experts the cache may lack
                work.new_last_token(2 * rnd + side.startswith("gather"))
            secs, outs[side] = timed(lambda: work.run(sides[side]))
            pcie = s.pcie_bytes - pcie0 if side != "compute" else 0
            rows.append({"card_gib": card, "slots": slots, "cached_fraction": round(slots / bank.total_experts, 4),
                         "side": side, "round": rnd, "tokens": tokens, "seconds": secs, "tok_s": tokens / secs,
                         "pcie_bytes": pcie, "device_copy_bytes": s.device_bytes - dev0 if side != "compute" else 0,
                         "restored_experts": getattr(s, "restored", 0) - back0, "seeded_experts": experts.seeded - seeded0,
                         "bound_seconds": pcie / (gbps * 1e9), "fraction_of_bound": pcie / (gbps * 1e9) / secs})
            print(f"[{card:g} GB] {side:16s} {secs:7.3f} s {tokens / secs:9.0f} tok/s  PCIe {pcie / 1e9:6.2f} GB  "
                  f"bound {pcie / (gbps * 1e9):6.3f} s", flush=True)
        diff = {f"{side} vs in place": (outs[side].float() - outs["in place"].float()).abs().max().item()
                for side in ("gather", "no cache")}
        rows[-1]["max_abs_difference"] = diff
        same = all(d == 0 for d in diff.values()) and same is not False
    torch.cuda.synchronize()
    return rows, bool(same)


def summary(rows: list[dict]) -> list[dict]:
    """Each (budget, side)'s median over its rounds."""
    out = []
    for card in dict.fromkeys(r["card_gib"] for r in rows):
        for side in SIDES:
            rs = [r for r in rows if r["card_gib"] == card and r["side"] == side]
            if rs:
                med = dict(rs[0], **{f: statistics.median(r[f] for r in rs)
                                     for f in ("seconds", "pcie_bytes", "device_copy_bytes", "bound_seconds")})
                med.pop("round")
                med.pop("max_abs_difference", None)
                med["tok_s"] = med["tokens"] / med["seconds"]
                med["fraction_of_bound"] = med["bound_seconds"] / med["seconds"]
                out.append(med)
    return out


def table(rows: list[dict]) -> None:
    print(f"{'card':>5} {'side':16} {'s/pass':>7} {'tok/s':>8} {'PCIe GB':>8} {'dev GB':>7} {'bound s':>8} "
          f"{'of bound':>8} {'vs gather':>9}")
    for r in rows:
        g = next(x for x in rows if x["card_gib"] == r["card_gib"]
                 and x["side"] == ("gather + seed" if "seed" in r["side"] else "gather"))
        print(f"{r['card_gib']:5g} {r['side']:16s} {r['seconds']:7.3f} {r['tok_s']:8.0f} {r['pcie_bytes'] / 1e9:8.2f} "
              f"{r['device_copy_bytes'] / 1e9:7.2f} {r['bound_seconds']:8.3f} {r['fraction_of_bound']:8.2f} "
              f"{g['seconds'] / r['seconds']:8.2f}x")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["summary"]
    cards = list(dict.fromkeys(r["card_gib"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(SIDES)
    for i, side in enumerate(SIDES):
        vals = [next((r["seconds"] for r in rows if r["card_gib"] == c and r["side"] == side), 0) for c in cards]
        ax.bar([j + width * (i - (len(SIDES) - 1) / 2) for j in range(len(cards))], vals, width, label=side)
    for j, c in enumerate(cards):
        bound = next(r["bound_seconds"] for r in rows if r["card_gib"] == c and r["side"] == "in place")
        ax.hlines(bound, j - 0.4, j + 0.4, colors="k", linestyles="dashed")
    ax.set_xticks(range(len(cards)), [f"{c:g} GB card\n{next(r['cached_fraction'] for r in rows if r['card_gib'] == c):.0%} cached"
                                      for c in cards])
    ax.set_ylabel(f"seconds per {rows[0]['tokens']}-token prefill pass (median)")
    ax.set_title(f"prefill with part of the experts cached ({result['layers']} layers, {result['model']}; dashed: in place's "
                 f"PCIe bound)\n{result['hardware'].get('gpu', '?')}, {result['hardware']['cpu']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=0, help="only the first N MoE layers (smoke tests)")
    ap.add_argument("--budgets", default="16,32", help="card sizes in GiB whose expert cache is emulated")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench/results/prefill_cached.json"))
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out")
    args = ap.parse_args()
    out = Path(args.out)
    if args.plot_only:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return
    model = dict(MODELS[args.model])
    if args.layers:
        model["layers"] = args.layers
    t0 = time.perf_counter()
    bank = Bank(model)
    print(f"bank: {bank.bytes / 1e9:.1f} GB pinned in {time.perf_counter() - t0:.0f} s", flush=True)
    gbps = pcie_gbps(bank)
    result = {"benchmark": "prefill_cached", "model": args.model, "layers": model["layers"], "hardware": describe(),
              "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory, "b_pcie_gbps": gbps,
              "method": __doc__, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": [],
              "in_place_equals_gather": {}}
    for card in (float(c) for c in args.budgets.split(",")):
        rows, same = budget_rows(bank, card, args.tokens, args.rounds, gbps, MODELS[args.model]["layers"])
        torch.cuda.empty_cache()          # the budget's slot pool is gone with its rows' function
        result["rows"] += rows
        result["in_place_equals_gather"][f"{card:g}"] = same
        if not same:
            print(f"WARNING {card:g} GB: the passes differ (max abs differences in the JSON)")
    result["summary"] = summary(result["rows"])
    table(result["summary"])
    print(f"B_pcie {gbps:.1f} GB/s; in place == gather bit for bit: {result['in_place_equals_gather']}")
    save(result, out, plot)


if __name__ == "__main__":
    main()
