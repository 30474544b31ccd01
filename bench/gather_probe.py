"""How fast the decode fills' gather reads pinned host memory on this GPU host, against the DMA.

Decode fills a layer call's missed experts with one launch of ``gather_fill_rows`` (the GPU reads
the pinned bank through unified addressing, kernels/triton/gather.py); the calibration and the
prefill stream use DMA copies. Stop 66's H100 host gathered at 47-51 GB/s beside a 53 GB/s DMA,
stop 68's at 30-34 (`--tune-gather`'s four tile candidates gave 1.3-1.8 GB/s for some at one
fill a launch). This bench measures, on one host in one process:

* the DMA: one expert's rows (9.4 MB, Qwen3-30B-A3B's shape) a copy, 1 and 8 experts queued;
* the gather over a grid of tiles (chunks a fill x words a chunk iteration x warps), 1 and 8
  fills a launch, a different expert each launch (64 experts, 0.6 GB: beyond the GPU's L2);
* both from two kinds of pinned memory: the engine's (host pages registered in place,
  ``ExpertBank.pin``) and a page-locked allocation of CUDA's own (``torch.Tensor.pin_memory``).

Prints a table, saves JSON and a PNG (the best tiles per chunk count against the DMA).

    python bench/gather_probe.py [--quick] [--out bench/results/gather_probe.json]
    python bench/gather_probe.py --device cpu --quick     # a dry run under TRITON_INTERPRET=1
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload_workload import ROOT  # noqa: E402  (first: it makes the engine package importable)
from hardware import describe  # noqa: E402
from report import main as bench_main  # noqa: E402

FULL = {"chunks": (4, 8, 16, 32, 64, 128), "block": (1024, 2048, 4096), "warps": (4, 8)}
QUICK = {"chunks": (8, 16, 32), "block": (2048,), "warps": (8,)}


def _seconds(fn, reps: int, device: torch.device) -> float:
    """Seconds for ``reps`` calls of ``fn`` queued back to back (CUDA events; the clock on a CPU)."""
    if device.type == "cuda":
        from offload_bandwidth import events_seconds
        return events_seconds(fn, reps)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return time.perf_counter() - t


def _banks(experts: int, hidden: int, inter: int, device: torch.device) -> dict:
    """name -> (w13 [1, E, 2I, H], w2 [1, E, H, I]) in host memory, pinned as named on a GPU."""
    from freetoken_engine.cache.bank import ExpertBank
    reg = ExpertBank(1, experts, hidden, inter, torch.bfloat16)
    for t in (reg.w13, reg.w2):
        t.view(torch.int16).random_()
    banks = {"registered": (reg.w13, reg.w2)}
    if device.type == "cuda":
        reg.pin()
        banks["cuda-allocated"] = (reg.w13.pin_memory(), reg.w2.pin_memory())
    return banks


def run(args) -> dict:
    from freetoken_engine.kernels.triton import gather as gather_mod
    from freetoken_engine.kernels.triton.gather import gather_fill_rows
    device = torch.device(args.device)
    hidden, inter, experts = (2048, 768, 64) if device.type == "cuda" else (64, 32, 16)
    reps = 32 if device.type == "cuda" else 2
    grid = QUICK if args.quick else FULL
    slots = 8
    d13 = torch.empty((slots, 2 * inter, hidden), dtype=torch.bfloat16, device=device)
    d2 = torch.empty((slots, hidden, inter), dtype=torch.bfloat16, device=device)
    se = 3 * hidden * inter * 2
    rows = []
    for name, (w13, w2) in _banks(experts, hidden, inter, device).items():
        turn = [0]

        def dma(n: int) -> None:
            for i in range(n):
                e = (turn[0] + i) % experts
                d13[i].copy_(w13[0, e], non_blocking=True)
                d2[i].copy_(w2[0, e], non_blocking=True)
            turn[0] += n

        for n in (1, 8):
            dma(n)
            rows.append({"bank": name, "path": "dma", "fills": n,
                         "gbps": n * se * reps / _seconds(lambda: dma(n), reps, device) / 1e9})
        ids = [torch.arange(i, i + 8, device=device) % experts for i in range(experts)]
        slot_ids = torch.arange(8, device=device)
        for chunks in grid["chunks"]:
            for block in grid["block"]:
                for warps in grid["warps"]:
                    gather_mod.GATHER_TILES = {"chunks": chunks, "block": block, "warps": warps}
                    for n in (1, 8):
                        def fill() -> None:
                            turn[0] += 1
                            gather_fill_rows(w13, w2, d13, d2, 0, ids[turn[0] % experts][:n], slot_ids[:n])
                        fill()                                      # compiles this tile's kernel
                        rows.append({"bank": name, "path": "gather", "fills": n, "chunks": chunks, "block": block,
                                     "warps": warps, "gbps": n * se * reps / _seconds(fill, reps, device) / 1e9})
                        r = rows[-1]
                        print(f"{name:15s} gather {chunks:3d}x{block:5d} w{warps} {n} fills {r['gbps']:7.1f} GB/s",
                              flush=True)
        # the last tiles' copies are exact: 8 fills of known experts
        gather_fill_rows(w13, w2, d13, d2, 0, ids[3], slot_ids)
        bits = lambda t: t.cpu().view(torch.int16)   # noqa: E731  (random bits: NaNs compare by bits)
        exact = all(torch.equal(bits(d13[i]), bits(w13[0, e])) and torch.equal(bits(d2[i]), bits(w2[0, e]))
                    for i, e in enumerate(ids[3].tolist()))
        if not exact:
            raise RuntimeError(f"{name}: the gather's rows differ from the bank's")
    for r in rows:
        if r["path"] == "dma":
            print(f"{r['bank']:15s} dma {r['fills']} experts queued {r['gbps']:7.1f} GB/s")
    return {"benchmark": "gather_probe", "hardware": {**describe(), "gpu": torch.cuda.get_device_name()
                                                     if device.type == "cuda" else None},
            "device": device.type, "interpret": os.environ.get("TRITON_INTERPRET") == "1",
            "expert_bytes": se, "experts": experts, "reps": reps, "rows": rows,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def plot(result: dict, path: Path) -> None:
    """Per bank and fills a launch: the best gather tiles at each chunk count, the DMA beside."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    banks = list(dict.fromkeys(r["bank"] for r in rows))
    fig, axes = plt.subplots(1, len(banks), figsize=(6 * len(banks), 4), squeeze=False)
    for ax, bank in zip(axes[0], banks):
        for n, colour in ((1, "tab:blue"), (8, "tab:orange")):
            mine = [r for r in rows if r["bank"] == bank and r["fills"] == n]
            chunks = sorted({r["chunks"] for r in mine if r["path"] == "gather"})
            best = [max(r["gbps"] for r in mine if r.get("chunks") == c) for c in chunks]
            ax.plot(chunks, best, "o-", color=colour, label=f"gather, {n} fills a launch (best tiles)")
            dma = next(r["gbps"] for r in mine if r["path"] == "dma")
            ax.axhline(dma, color=colour, linestyle="--", label=f"DMA, {n} experts queued")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("chunks a fill")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{bank} pinned memory: {result['hardware'].get('gpu')}", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 tile candidates instead of 36")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script under TRITON_INTERPRET=1")
    bench_main(ap, ROOT / "bench/results/gather_probe.json", run, plot)
