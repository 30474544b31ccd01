"""gpt-oss's experts kept in MXFP4 on the GPU against the same experts stored as bfloat16, in
gpt-oss-20b's expert shape (H 2880, I 2880, 32 experts a layer, top 4): the Triton MoE kernels on a
layer's slot pool (decode calls of 1, 4 and 16 tokens, prefill calls of 128-2,048 tokens over the
whole layer) and the step's fills (``gather_fill_rows``: 4 experts of a layer from the pinned host
bank over PCIe), each side in this one process, in turn. The 4-bit pool holds random codes and
scales; the bf16 pool holds exactly their values, so both compute the same products (checked
within bf16 rounding before timing: the kernels may sum them in another order). Reported:
microseconds a call, the expert bytes it reads as GB/s (4.25 bits a value against 16), the
speed-up, and how many experts a GB of expert cache holds.

Decode calls (at most 64 pairs) are timed as the engine runs them: inside one CUDA graph of
``GRAPH_CALLS`` calls, each over other routing (one token: a walk over the layer's experts, so
consecutive calls share none), the median of ``--reps`` replays. Timed one launch at a time
instead (CUDA events around each call, as this bench did before 2026-12-05), a decode call
measures the host's launches: bf16 162 us against 17 in a graph on the H100. Larger calls and the
fills: CUDA events around each call, the median of ``--reps``.

    python bench/mxfp4_gpu.py [--reps 50] [--layers 4] [--sweep]

``--sweep``: the 4-bit calls of 1, 4 and 16 tokens again under other tiles of the kernels
(``moe.LANES_TILES_MX`` for one token, ``moe.DECODE_TILES`` for a few), the defaults restored after.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from gemv import graph_us  # noqa: E402
from hardware import describe  # noqa: E402
import report  # noqa: E402

H = I = 2880
E, K = 32, 4
CALLS = [1, 4, 16, 128, 512, 1024, 2048]          # tokens a MoE call (top 4 of 32 experts each)
#: the 4-bit sides of a large call: the default rule, the slots decoded in the kernels' tiles, and
#: decoded first into the dense scratch (moe_mx_dense.MX_DENSE_PAIRS: None / 1)
LARGE_SIDES = {"mxfp4": "default", "mxfp4/in-kernel": None, "mxfp4/rounds": 1}
GRAPH_CALLS = 32              # decode calls in one timed CUDA graph


def pools(layers: int):
    """Host banks [L, E, ...] (pinned) of MXFP4 rows and their bf16 values."""
    from freetoken_engine.kernels import mxfp4
    g = torch.Generator().manual_seed(0)
    q13, q2 = mxfp4.random_rows((layers, E, 2 * I), H, g), mxfp4.random_rows((layers, E, H), I, g)
    d13 = torch.stack([mxfp4.dequantize(q13[layer], torch.bfloat16) for layer in range(layers)])
    d2 = torch.stack([mxfp4.dequantize(q2[layer], torch.bfloat16) for layer in range(layers)])
    return {"mxfp4": (q13.pin_memory(), q2.pin_memory()), "bf16": (d13.pin_memory(), d2.pin_memory())}


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls (CUDA events), after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def hbm_copy_rate() -> float:
    """GB/s of a 1 GiB device copy, its read and its write counted."""
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    return 2 * big.numel() / timed(lambda: big.clone(), 10) / 1e9


def routing(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    tok = torch.arange(tokens).repeat_interleave(K)
    slot = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).flatten()
    return tok.cuda(), slot.cuda()


def routings(tokens: int, calls: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``calls`` routings of ``tokens`` tokens; one token: a walk over the experts (call c takes
    the next K of a permutation), so consecutive calls read no expert twice."""
    if tokens > 1:
        return [routing(tokens, tokens * 1000 + c) for c in range(calls)]
    walk = torch.randperm(E, generator=torch.Generator().manual_seed(1)).tolist()
    tok = torch.zeros(K, dtype=torch.int64, device="cuda")
    return [(tok, torch.tensor([walk[(c * K + j) % E] for j in range(K)], device="cuda")) for c in range(calls)]


def run(args) -> dict:
    from freetoken_engine.kernels.triton.gather import gather_fill_rows
    from freetoken_engine.kernels.triton.moe import SMALL_P, moe_slots_forward
    banks = pools(args.layers)
    dev = {k: (w13[0].cuda(), w2[0].cuda()) for k, (w13, w2) in banks.items()}      # layer 0 as the pool
    per_expert = {k: (w13.numel() + w2.numel()) * w13.element_size() // E for k, (w13, w2) in dev.items()}
    hbm = hbm_copy_rate()
    rows = []
    from freetoken_engine.kernels.triton import moe_mx_dense
    rule = moe_mx_dense.MX_DENSE_PAIRS

    def call(side: str, x, tok, slot):
        moe_mx_dense.MX_DENSE_PAIRS = rule if LARGE_SIDES.get(side, "default") == "default" else LARGE_SIDES[side]
        try:
            return moe_slots_forward(x, *dev[side.split("/")[0]], tok, slot, experts=E)
        finally:
            moe_mx_dense.MX_DENSE_PAIRS = rule

    for tokens in args.calls:
        x = torch.randn(tokens, H, device="cuda").to(torch.bfloat16)
        tok, slot = routing(tokens, tokens)
        order = ["bf16", "mxfp4"] + ([k for k in LARGE_SIDES if "/" in k] if tokens * K > 64 else [])
        want = moe_slots_forward(x, *dev["bf16"], tok, slot).float()
        err = {}
        for k in order[1:]:
            err[k] = ((call(k, x, tok, slot).float() - want).abs().max() / want.abs().max()).item()
            if err[k] > 2.0 ** -7:
                print(f"WRONG: {tokens} tokens, {k}: the 4-bit pool's rows are {err[k]:.3g} off its values' "
                      f"(of the output scale)")
        graphed = tokens * K <= SMALL_P
        if graphed:          # a decode call: in a graph of calls over other routing, as the engine runs it
            calls = [(x, t, s) for t, s in routings(tokens, GRAPH_CALLS)]
            distinct = statistics.mean(int(s.unique().numel()) for _, _, s in calls)
        else:
            distinct = int(slot.unique().numel())
        med = {}
        for r in range(2):
            for k in order[r:] + order[:r]:
                med.setdefault(k, []).append(
                    graph_us(lambda *a, k=k: call(k, *a), calls, args.reps) / 1e6 if graphed
                    else timed(lambda k=k: call(k, x, tok, slot), args.reps))
        med = {k: min(v) for k, v in med.items()}
        row = {"what": f"MoE call, {tokens} token{'s' if tokens > 1 else ''}", "tokens": tokens,
               "timing": f"one CUDA graph of {GRAPH_CALLS} calls" if graphed else "CUDA events a call",
               "experts_read": distinct, "us": {k: v * 1e6 for k, v in med.items()},
               "gb_per_s": {k: distinct * per_expert[k.split("/")[0]] / v / 1e9 for k, v in med.items()},
               "speedup": med["bf16"] / med["mxfp4"], "max_rel_err": err["mxfp4"],
               "speedups": {k: med["bf16"] / med[k] for k in order[1:]}, "max_rel_errs": err}
        rows.append(row)
    slots = {k: (torch.empty_like(dev[k][0]), torch.empty_like(dev[k][1])) for k in dev}
    fill_exp = torch.tensor([3, 11, 20, 29], device="cuda")
    fill_slot = torch.tensor([0, 5, 9, 30], device="cuda")
    med = {k: timed(lambda k=k: gather_fill_rows(*banks[k], *slots[k], 1, fill_exp, fill_slot), args.reps)
           for k in ("bf16", "mxfp4")}
    rows.append({"what": "fills, 4 experts from the pinned host bank", "tokens": 0, "experts_read": 4,
                 "us": {k: v * 1e6 for k, v in med.items()},
                 "gb_per_s": {k: 4 * per_expert[k] / v / 1e9 for k, v in med.items()},
                 "speedup": med["bf16"] / med["mxfp4"]})
    sweep = tile_sweep(dev, args.reps) if args.sweep else []
    for r in rows:
        print(f"{r['what']:45s} bf16 {r['us']['bf16']:9.1f} us ({r['gb_per_s']['bf16']:7.1f} GB/s)   "
              f"MXFP4 {r['us']['mxfp4']:9.1f} us ({r['gb_per_s']['mxfp4']:7.1f} GB/s)   {r['speedup']:.2f}x"
              + "".join(f"   {k} {r['us'][k]:9.1f} us {v:.2f}x" for k, v in r.get("speedups", {}).items() if "/" in k))
    per_gb = {k: int(1e9 // v) for k, v in per_expert.items()}
    print(f"an expert: {per_expert['bf16'] / 1e6:.1f} MB bf16, {per_expert['mxfp4'] / 1e6:.1f} MB MXFP4; "
          f"a GB of cache holds {per_gb['bf16']} / {per_gb['mxfp4']}; HBM copy {hbm:.0f} GB/s")
    return {"hardware": describe(), "gpu": torch.cuda.get_device_name(), "hbm_copy_gb_per_s": hbm,
            "shape": {"hidden": H, "intermediate": I, "experts": E, "top_k": K}, "expert_bytes": per_expert,
            "experts_per_gb": per_gb, "reps": args.reps, "rows": rows, "tile_sweep": sweep}


LANES = [None, {"bn1": 2, "bk1": 2048, "bn2": 8, "bk2": 256}, {"bn1": 2, "bk1": 2048, "bn2": 4, "bk2": 1024},
         {"bn1": 4, "bk1": 1024, "bn2": 8, "bk2": 512}, {"bn1": 1, "bk1": 2048, "bn2": 2, "bk2": 2048},
         {"bn1": 4, "bk1": 2048, "bn2": 16, "bk2": 256}, {"bn1": 8, "bk1": 512, "bn2": 8, "bk2": 512},
         {"bn1": 4, "bk1": 512, "bn2": 16, "bk2": 512}, {"bn1": 2, "bk1": 1024, "bn2": 4, "bk2": 512},
         {"bn1": 8, "bk1": 1024, "bn2": 32, "bk2": 256}]
TILED = [{"bn1": 32, "bk1": 128, "bn2": 64, "bk2": 128}, {"bn1": 32, "bk1": 256, "bn2": 64, "bk2": 256},
         {"bn1": 16, "bk1": 256, "bn2": 32, "bk2": 256}, {"bn1": 64, "bk1": 128, "bn2": 64, "bk2": 256}]


def tile_sweep(dev: dict, reps: int) -> list[dict]:
    """us of the 4-bit calls of 1, 4 and 16 tokens (each in one CUDA graph of ``GRAPH_CALLS``
    calls) under each candidate tile set (4 warps; None: one token on the tiled kernels), and their
    largest difference from the bf16 pool's rows."""
    from freetoken_engine.kernels.triton import moe
    from freetoken_engine.kernels.triton.moe import moe_slots_forward
    saved, out = (dict(moe.LANES_TILES_MX), dict(moe.DECODE_TILES)), []
    try:
        for tokens, tiles, name in [(1, t, "lanes") for t in LANES] + [(n, t, "decode") for n in (4, 16) for t in TILED]:
            x = torch.randn(tokens, H, device="cuda").to(torch.bfloat16)
            tok, slot = routing(tokens, tokens)
            setattr(moe, "LANES_TILES_MX" if name == "lanes" else "DECODE_TILES", tiles and {"warps": 4, **tiles})
            want = moe_slots_forward(x, *dev["bf16"], tok, slot).float()
            try:
                err = ((moe_slots_forward(x, *dev["mxfp4"], tok, slot).float() - want).abs().max()
                       / want.abs().max()).item()
                calls = [(x, t, s) for t, s in routings(tokens, GRAPH_CALLS)]
                us = graph_us(lambda *a: moe_slots_forward(a[0], *dev["mxfp4"], a[1], a[2]), calls, reps)
            except Exception as exc:    # a tile set this GPU's compiler refuses: said, and the sweep goes on
                print(f"sweep: {tokens:2d} tokens, {name} {tiles}: failed: {str(exc).splitlines()[0][:200]}")
                out.append({"tokens": tokens, "kernels": name, "tiles": tiles, "error": str(exc)[:500]})
                continue
            out.append({"tokens": tokens, "kernels": name, "tiles": tiles, "us": us, "max_rel_err": err})
            print(f"sweep: {tokens:2d} tokens, {name} {tiles}: {us:8.1f} us, error {err:.2g}")
    finally:
        moe.LANES_TILES_MX, moe.DECODE_TILES = saved
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.bar(range(len(rows)), [r["speedup"] for r in rows], color="tab:green")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), [r["what"].replace("MoE call, ", "").replace(" from the pinned host bank", "")
                                     for r in rows], fontsize=8, rotation=15)
    ax.set_ylabel("MXFP4 speed-up over bf16 (same values)")
    ax.set_title(f"gpt-oss-20b experts on {result['gpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=4, help="layers of the host bank the fills read from")
    ap.add_argument("--sweep", action="store_true", help="the 4-bit decode calls under other tiles too")
    ap.add_argument("--calls", type=lambda v: [int(t) for t in v.split(",")], default=CALLS,
                    help="tokens of the MoE calls timed, comma-separated (default: %(default)s)")
    report.main(ap, ROOT / "bench" / "results" / "mxfp4_gpu.json", run, plot)


if __name__ == "__main__":
    main()
