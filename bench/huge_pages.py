"""The expert bank on transparent huge pages against 4 KiB pages, both sides in one process.

Until the twenty-fifth stop the bank's mapping was shared anonymous memory (``mmap(-1, n)``'s
default), whose huge pages follow ``shmem_enabled`` ("never" by default), so the engine's
``MADV_HUGEPAGE`` did nothing: every 4 KiB expert row sat on its own page. ``packed.memory.arena``
now maps private memory. This bench allocates two banks of the same experts (Qwen3-30B-A3B expert
shape, bf16, at least 8x the last-level cache), one per side (``arena(huge=True / False)``), and
measures, alternating the sides' order every round:

* fill: the first write of the whole bank (page faults included), as a load fills it;
* read: the STREAM-style read of all CPUs (``ft_read``), the CPU kernel's yardstick;
* the CPU expert kernel from C (``calls_seconds``, as the GPU decode's CPU branch calls it):
  1 expert a call, one token on 8 experts, 4 and 8 tokens on the same 8 experts;
* on a GPU: page-locking the bank (``cudaHostRegister``), the engine's fill gather (the device
  reads 8 experts a launch from the pinned bank, ``kernels/triton/gather.py``) and per-expert
  ``cudaMemcpyAsync`` copies.

    python bench/huge_pages.py --label NAME [--rounds 3] [--experts E] [--out DIR]

Writes DIR/huge_pages.json (this machine's entry merged with the others') and a PNG of the
huge / small ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from cpu_expert_kernel import RESULTS, H, I, K, bank_tensor, c_gbps, fill_block, hardware, make_plans, write_results
from freetoken_engine.kernels import cpu_experts as ce
from freetoken_engine.packed import memory

SIDES = ("huge", "small")
CASES = (("1_expert", "1_expert", 1), ("one_token", "one_token", 1), ("same_experts_T4", "same_experts", 4),
         ("same_experts_T8", "same_experts", 8))     # (name, cpu_expert_kernel.make_plans mode, tokens)
EXPERT_BYTES = 3 * H * I * 2


def make_bank(E: int, huge: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
    """w13 [1, E, 2I, H] and w2 [1, E, H, I] bf16 on one side's pages, and the fill's GB/s."""
    fill_block()                    # made once, outside the clock
    t0 = time.perf_counter()
    w13, w2 = bank_tensor(1, E, 2 * I, H, huge=huge), bank_tensor(1, E, H, I, huge=huge)
    return w13, w2, E * EXPERT_BYTES / (time.perf_counter() - t0) / 1e9


def read_gbps(w13, min_s: float) -> float:
    flat = w13.view(-1)
    n, secs = 0, 0.0
    while secs < min_s:
        secs += ce.read_seconds(flat)
        n += 1
    return n * flat.numel() * 2 / secs / 1e9


def gpu_gbps(w13, w2, slots, gen: torch.Generator, min_s: float, how: str) -> float:
    """GB/s of 8-expert fills from the pinned bank: the gather kernel or per-expert copies."""
    from freetoken_engine.kernels.triton.gather import gather_fill_rows
    s13, s2 = slots
    E, dev = w13.shape[1], s13.device
    fill_slot = torch.arange(K, device=dev)
    n = 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < min_s:
        ids = torch.randperm(E, generator=gen)[:K]
        if how == "gather":
            gather_fill_rows(w13, w2, s13, s2, 0, ids.to(dev, non_blocking=True), fill_slot)
        else:
            for j, e in enumerate(ids.tolist()):
                s13[j].copy_(w13[0, e], non_blocking=True)
                s2[j].copy_(w2[0, e], non_blocking=True)
        n += 1
        if n % 16 == 0:
            torch.cuda.synchronize(dev)
    end.record()
    end.synchronize()
    return n * K * EXPERT_BYTES / (start.elapsed_time(end) / 1e3) / 1e9


def measure(args) -> dict:
    hw = hardware()
    llc = hw.get("llc_bytes") or (32 << 20)
    E = args.experts or max(384, -(-8 * llc // EXPERT_BYTES))
    gpu = torch.cuda.is_available() and not args.no_gpu
    banks, fill, huge_bytes, pin_s = {}, {}, {}, {}
    for side in SIDES:
        w13, w2, fill[side] = make_bank(E, side == "huge")
        huge_bytes[side] = memory.huge_page_bytes(w13) + memory.huge_page_bytes(w2)
        banks[side] = (w13, w2)
        print(f"{side}: {E} experts, fill {fill[side]:.1f} GB/s, {huge_bytes[side] / 2**30:.2f} GiB on huge pages",
              flush=True)
    if gpu:
        dev = torch.device("cuda")
        slots = (torch.empty(K, 2 * I, H, dtype=torch.bfloat16, device=dev),
                 torch.empty(K, H, I, dtype=torch.bfloat16, device=dev))
        for side in SIDES:
            t0 = time.perf_counter()
            banks[side] += tuple(memory.host_register(t) for t in banks[side])
            pin_s[side] = time.perf_counter() - t0
            print(f"{side}: pinned in {pin_s[side]:.2f} s", flush=True)
            for how in ("gather", "memcpy"):        # Triton compiles the gather on its first call
                gpu_gbps(*banks[side][:2], slots, torch.Generator().manual_seed(1), 0.05, how)
    x = (torch.randn(8, H) * 0.1).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    plans = {name: make_plans(E, T, mode, gen) for name, mode, T in CASES}
    rows: dict[str, dict[str, list[float]]] = {s: {} for s in SIDES}
    for rnd in range(args.rounds):
        for side in (SIDES if rnd % 2 == 0 else SIDES[::-1]):
            w13, w2 = banks[side][:2]
            got = {"read": read_gbps(w13, args.seconds)}
            for name, _, _ in CASES:
                got[f"kernel/{name}"] = c_gbps(x, w13[0], w2[0], plans[name], args.seconds, EXPERT_BYTES)
            if gpu:
                for how in ("gather", "memcpy"):
                    got[f"gpu/{how}"] = gpu_gbps(w13, w2, slots, gen, args.seconds, how)
            for k, v in got.items():
                rows[side].setdefault(k, []).append(v)
            print(f"round {rnd} {side:5s} " + " ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    results = {}
    for key in rows["huge"]:
        med = {s: statistics.median(rows[s][key]) for s in SIDES}
        results[key] = {"huge_gbps": rows["huge"][key], "small_gbps": rows["small"][key],
                        "ratio_of_medians": med["huge"] / med["small"]}
        if key.startswith("kernel/"):
            for s in SIDES:
                results[key][f"{s}_fraction_of_read"] = [k / r for k, r in zip(rows[s][key], rows[s]["read"])]
    print(f"{'measure':28s} {'huge':>8s} {'small':>8s} {'huge/small':>10s}")
    for key, r in results.items():
        print(f"{key:28s} {statistics.median(r['huge_gbps']):8.1f} {statistics.median(r['small_gbps']):8.1f} "
              f"{r['ratio_of_medians']:9.2f}x")
    if gpu:
        hw["gpu"] = torch.cuda.get_device_name()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return {"measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "hardware": hw,
            "kernel_backend": ce.backend_name(), "threads": ce.default_threads(),
            "thp_enabled": thp.read_text().strip() if thp.exists() else None,
            "bank": {"experts": E, "expert_bytes": EXPERT_BYTES, "bytes_per_side": E * EXPERT_BYTES},
            "huge_page_bytes": huge_bytes, "fill_gbps": fill, "pin_seconds": pin_s or None,
            "rounds": args.rounds, "seconds_per_measure": args.seconds, "results": results}


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    machines = data["machines"]
    fig, axes = plt.subplots(len(machines), 1, figsize=(9, 3.6 * len(machines)), squeeze=False)
    for ax, (label, m) in zip(axes[:, 0], machines.items()):
        keys = list(m["results"])
        ax.barh(range(len(keys)), [m["results"][k]["ratio_of_medians"] for k in keys])
        ax.set_yticks(range(len(keys)), keys, fontsize=7)
        ax.axvline(1.0, color="k", ls="--")
        ax.set_xlabel("huge pages / 4 KiB pages (median GB/s, same process)")
        ax.set_title(f"{label}: {m['hardware']['cpu_model']}, {m['hardware']['cpus']} CPUs"
                     + (f", {m['hardware']['gpu']}" if "gpu" in m["hardware"] else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True, help="this machine's entry in the results")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--experts", type=int, default=0, help="experts per side (default: 8x the LLC, at least 384)")
    ap.add_argument("--seconds", type=float, default=0.4, help="per measure, side and round")
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    out = args.out / "huge_pages.json"
    data = json.loads(out.read_text()) if out.exists() else {}
    data.update({"benchmark": "huge_pages", "method": __doc__.strip().split("\n\n")[1]})
    data.setdefault("machines", {})[args.label] = measure(args)
    write_results(out, data, plot)


if __name__ == "__main__":
    main()
