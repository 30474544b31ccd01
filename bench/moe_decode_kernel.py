"""A batch-1 decode call's routed experts on the GPU: the lanes kernels against the tiled ones
(kernels/triton/moe.py), same process, same weights.

At batch 1 a layer's call has top-k pairs of one token. The engine runs the hits' pairs while the
fills cross PCIe, then the filled pairs (``DeviceControl.run_experts``), each call over all k
pairs with the others' slots at -1: so a call often has one or two experts to compute, right
after a copy, on the critical path of the step. The tiled kernels give an expert I / 32 + H / 64
programs (56 for Qwen3-30B's expert on a 132-SM H200); the lanes kernels give it I / 2 + H / 8
(640).

Patterns (k = 8 pairs a call, one token): ``n of 8`` = n pairs with a slot, the rest -1, as the
engine's calls over hits or fills. Each case is timed as the engine runs it: inside one CUDA
graph of ``--calls`` calls over different slots of a pool at least 4x the GPU's L2, so each call
reads its experts from HBM; us per call = replay time / calls (median of ``--rounds`` replays);
GB/s = the experts' bytes / that time, against a read of HBM measured in the same run (torch's
sum over 2 GiB; a device copy's read + write rate is reported beside it).
``--sweep`` also times the lanes kernels' tiles on the 1-of-8 and 8-of-8 patterns. Every side is
checked against the PyTorch reference (max error relative to the output's largest value).
Writes JSON + PNG (hardware named) and prints a table.

    python bench/moe_decode_kernel.py [--sweep] [--out bench/results/moe_decode_kernel.json] [--plot-only]
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "engine"))
from gemv import graph_us  # noqa: E402
from hardware import describe  # noqa: E402
from report import save  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (2048, 768), "qwen3.6-35b-a3b": (2048, 512)}     # H, I
K = 8


def hbm_gbps(rounds: int) -> dict:
    """HBM figures of this GPU in this run, 2 GiB each: a device-to-device copy (bytes read and
    written / time) and a read (torch's sum over bf16, bytes read / time)."""
    n = 2 << 30
    a = torch.zeros(n // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    s = torch.empty((), dtype=torch.float32, device="cuda")
    out = {}
    for name, fn, nbytes in (("copy", lambda: b.copy_(a), 2 * n),
                             ("read", lambda: s.copy_(torch.sum(a, dtype=torch.float32)), n)):
        out[f"{name}_gbps"] = nbytes / graph_us(fn, [()], rounds) / 1e3
    return out


def time_side(moe, lanes, pool13, pool2, x, tok, slot_sets, rounds: int) -> float:
    """us per call of moe_slots_forward over ``slot_sets`` with ``LANES_TILES = lanes``."""
    moe.LANES_TILES = lanes
    out = torch.empty(K, x.shape[1], dtype=x.dtype, device="cuda")
    return graph_us(lambda ps: moe.moe_slots_forward(x, pool13, pool2, tok, ps, out=out, zero=False),
                    [(ps,) for ps in slot_sets], rounds, warm=1)


def error(moe, lanes, pool13, pool2, x, tok, ps) -> float:
    from freetoken_engine.kernels.reference import expert_pairs_forward
    moe.LANES_TILES = lanes
    got = moe.moe_slots_forward(x, pool13, pool2, tok, ps).float()
    keep = ps >= 0
    ref = expert_pairs_forward(x.float(), pool13.float(), pool2.float(), tok, ps.clamp(min=0)).float()
    return ((got - ref)[keep].abs().max() / ref[keep].abs().max()).item()


def sweep_configs() -> list[dict]:
    """Gate/up tiles with the down tiles at the default, then the down tiles with gate/up at the
    default, each at 4 and 8 warps."""
    from freetoken_engine.kernels.triton.moe import LANES_TILES
    base = dict(LANES_TILES)
    out = []
    for warps in (4, 8):
        for bn1 in (2, 4, 8):
            for bk1 in (256, 512, 1024, 2048):
                if 2 * bn1 * bk1 <= 16384:
                    out.append({**base, "bn1": bn1, "bk1": bk1, "warps": warps})
        for bn2 in (4, 8, 16, 32):
            for bk2 in (128, 256, 512):
                if bn2 * bk2 <= 8192 and (bn2, bk2) != (base["bn2"], base["bk2"]):
                    out.append({**base, "bn2": bn2, "bk2": bk2, "warps": warps})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--patterns", default="1,2,4,6,8")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench/results/moe_decode_kernel.json"))
    ap.add_argument("--plot-only", action="store_true", help="redraw --out's PNG from its JSON")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return
    from freetoken_engine.kernels.triton import moe
    default = dict(moe.LANES_TILES)
    torch.manual_seed(0)
    rates = hbm_gbps(args.rounds)
    hbm = rates["read_gbps"]
    print(f"HBM: read {hbm:.0f} GB/s, copy (read + write) {rates['copy_gbps']:.0f} GB/s", flush=True)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows, sweep = [], []
    for name, (h, inter) in SHAPES.items():
        expert_bytes = 3 * h * inter * 2
        slots = max(2 * K, -(-4 * l2 // expert_bytes) + K)
        pool13 = (torch.randn(slots, 2 * inter, h, device="cuda") * h ** -0.5).to(torch.bfloat16)
        pool2 = (torch.randn(slots, h, inter, device="cuda") * inter ** -0.5).to(torch.bfloat16)
        x = torch.randn(1, h, device="cuda").to(torch.bfloat16)
        tok = torch.zeros(K, dtype=torch.int64, device="cuda")

        def sets(n: int) -> list[torch.Tensor]:
            """``calls`` slot lists with n slots (the rest -1), walking the pool so consecutive
            calls never share a slot and each slot recurs only after the pool's other slots."""
            order = torch.randperm(slots).tolist()
            out, pos = [], 0
            for _ in range(args.calls):
                ps = [-1] * K
                for j in sorted(torch.randperm(K)[:n].tolist()):
                    ps[j] = order[pos % slots]
                    pos += 1
                out.append(torch.tensor(ps, device="cuda"))
            return out

        for n in [int(v) for v in args.patterns.split(",")]:
            calls = sets(n)
            row = {"shape": name, "H": h, "I": inter, "experts_per_call": n, "pairs": K, "pool_slots": slots,
                   "expert_bytes": expert_bytes}
            for side, lanes in (("tiled", None), ("lanes", default)):
                us = time_side(moe, lanes, pool13, pool2, x, tok, calls, args.rounds)
                row[f"{side}_us"] = us
                row[f"{side}_gbps"] = n * expert_bytes / us / 1e3
                row[f"{side}_of_read"] = row[f"{side}_gbps"] / hbm
                row[f"{side}_max_rel_err"] = error(moe, lanes, pool13, pool2, x, tok, calls[0])
            row["speedup"] = row["tiled_us"] / row["lanes_us"]
            rows.append(row)
            print(f"{name:16} {n} of 8: tiled {row['tiled_us']:6.2f} us ({row['tiled_gbps']:5.0f} GB/s, "
                  f"{row['tiled_of_read']:.2f})  lanes {row['lanes_us']:6.2f} us ({row['lanes_gbps']:5.0f} GB/s, "
                  f"{row['lanes_of_read']:.2f})  {row['speedup']:.2f}x  err {row['tiled_max_rel_err']:.1e} / "
                  f"{row['lanes_max_rel_err']:.1e}", flush=True)
            if args.sweep and n in (1, 8):
                for cfg in sweep_configs():
                    us = time_side(moe, cfg, pool13, pool2, x, tok, calls, args.rounds)
                    sweep.append({"shape": name, "experts_per_call": n, "tiles": cfg, "us": us,
                                  "gbps": n * expert_bytes / us / 1e3})
                best = min((r for r in sweep if r["shape"] == name and r["experts_per_call"] == n), key=lambda r: r["us"])
                print(f"  sweep best {best['tiles']} {best['us']:.2f} us", flush=True)
        del pool13, pool2
        torch.cuda.empty_cache()
    moe.LANES_TILES = default
    result = {"benchmark": "moe_decode_kernel", "hardware": describe(), "method": __doc__,
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", "bench/moe_decode_kernel.py"] + sys.argv[1:]),
              **{f"hbm_{k}": v for k, v in rates.items()}, "lanes_tiles": default, "rows": rows, "sweep": sweep}
    save(result, Path(args.out), plot)
    print(f"wrote {args.out}")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = range(len(rows))
    ax.bar([i - 0.2 for i in xs], [r["tiled_gbps"] for r in rows], 0.4, label="tiled (tl.dot, 16-row pad)")
    ax.bar([i + 0.2 for i in xs], [r["lanes_gbps"] for r in rows], 0.4, label="lanes (one token)")
    ax.axhline(result["hbm_read_gbps"], color="k", lw=0.8, ls="--", label="HBM read (torch sum)")
    ax.set_xticks(list(xs), [f"{r['shape']}\n{r['experts_per_call']} of 8" for r in rows], fontsize=6, rotation=90)
    ax.set_ylabel("expert GB/s (one CUDA graph of calls)")
    ax.set_title(f"batch-1 MoE call, bf16: {result['hardware'].get('gpu', '?')}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
