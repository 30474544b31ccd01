"""Bandwidths that ``bench/gpu_offload.py`` measures: pinned DMA, the fill gather (GPU reading the
pinned bank), HBM copies, the CPU expert kernel alone and beside each, by experts per call; and
the gather's tile tuning."""
from __future__ import annotations

import time

import torch

from offload_workload import CUDA, Bank  # first: it makes the engine package importable
from freetoken_engine.kernels.triton import gather as gather_mod
from freetoken_engine.kernels.triton.gather import gather_fill_rows


def events_seconds(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def tune_gather(bank: Bank) -> dict:
    """Time the fill gather (GPU reading the pinned bank) for 1 and 8 fills per launch over
    grid/tile candidates; set the fastest (harmonic mean of the two rates) as GATHER_TILES."""
    m = bank.model
    d13 = torch.empty((8, *bank.w13.shape[2:]), dtype=torch.bfloat16, device=CUDA)
    d2 = torch.empty((8, *bank.w2.shape[2:]), dtype=torch.bfloat16, device=CUDA)
    rows, counter = [], [0]
    for chunks, block, warps in ((16, 2048, 8), (32, 2048, 8), (64, 1024, 4), (128, 1024, 4)):
        gather_mod.GATHER_TILES = {"chunks": chunks, "block": block, "warps": warps}
        row = {"tiles": dict(gather_mod.GATHER_TILES)}
        for n in (1, 8):
            exp, slot = torch.arange(n, device=CUDA) + 16, torch.arange(n, device=CUDA)

            def fill():
                counter[0] += 1
                gather_fill_rows(bank.w13, bank.w2, d13, d2, counter[0] % m["layers"], exp, slot)

            fill()
            row[f"gbps_{n}"] = n * m["expert_bytes"] * 16 / events_seconds(fill, 16) / 1e9
        rows.append(row)
    best = max(rows, key=lambda r: 1 / (1 / r["gbps_1"] + 1 / r["gbps_8"]))
    gather_mod.GATHER_TILES = best["tiles"]
    return {"candidates": rows, "chosen": best["tiles"]}


def _hbm_copy_gbps() -> float:
    """A 1 GiB device-to-device copy's read + write rate, GB/s (its buffers freed on return)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=CUDA)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 20 / events_seconds(lambda: dst.copy_(src), 20) / 1e9


def bandwidths(bank: Bank, cpu_fn) -> dict:
    """GB/s (1e9 B/s): pinned H2D DMA of expert rows, the gather kernel's fills (GPU reading the
    pinned bank), HBM copy (read + write counted), the CPU expert kernel (one token; calls of 8
    experts and of 1 expert, the decode case), and each GPU transfer with the CPU kernel running
    at once. The CPU kernel runs on the main thread while queued GPU copies run (no extra host
    thread competes with its workers for cores). fill_fraction: from the gather + 1-expert CPU
    pair, measured concurrently (what decode's CPU branch sees)."""
    m = bank.model
    L, E, se = m["layers"], m["experts"], m["expert_bytes"]
    n = 8
    d13 = torch.empty((n, *bank.w13.shape[2:]), dtype=torch.bfloat16, device=CUDA)
    d2 = torch.empty((n, *bank.w2.shape[2:]), dtype=torch.bfloat16, device=CUDA)
    counter = [0]

    def dma():
        layer = counter[0] % L
        counter[0] += 1
        for i in range(n):
            d13[i].copy_(bank.w13[layer, i], non_blocking=True)
            d2[i].copy_(bank.w2[layer, i], non_blocking=True)

    fill_exp = torch.arange(n, device=CUDA) + 16
    fill_slot = torch.arange(n, device=CUDA)

    def gather():
        layer = counter[0] % L
        counter[0] += 1
        gather_fill_rows(bank.w13, bank.w2, d13, d2, layer, fill_exp, fill_slot)

    # decode-sized fills: one expert per launch, a different one each time (a repeated expert
    # could be served from the GPU's L2, 50 MB on the H200)
    one_exp = [torch.tensor([16 + j], device=CUDA) for j in range(E - 16)]

    def gather1():
        layer = counter[0] % L
        counter[0] += 1
        gather_fill_rows(bank.w13, bank.w2, d13, d2, layer, one_exp[counter[0] % len(one_exp)], fill_slot[:1])

    dma(); gather(); gather1(); torch.cuda.synchronize()
    pcie = max(n * se * 24 / events_seconds(dma, 24) for _ in range(2)) / 1e9
    gat = max(n * se * 24 / events_seconds(gather, 24) for _ in range(2)) / 1e9
    gat1 = max(se * 192 / events_seconds(gather1, 192) for _ in range(2)) / 1e9
    hbm = _hbm_copy_gbps()
    x = torch.randn(1, m["hidden"]).to(torch.bfloat16)

    def cpu_call(i: int, experts: int) -> None:
        layer = i % L
        first = 32 + (i // L * experts) % (E - 32 - experts)
        cpu_fn(x, bank.w13[layer], bank.w2[layer], torch.zeros(experts, dtype=torch.int64),
               torch.arange(first, first + experts))

    from freetoken_engine.kernels import cpu_experts
    from_c = cpu_experts.available()

    def c_calls(i: int) -> tuple[int, float]:
        """8 one-expert calls of one layer run back to back from C (calls_seconds: as the
        engine's C++ branch runs them, no Python call around each); -> (experts, seconds)."""
        layer = i % L
        first = 32 + (i // L * 8) % (E - 40)
        exps = torch.arange(first, first + 8).view(8, 1)
        return 8, cpu_experts.calls_seconds(x, bank.w13[layer], bank.w2[layer], torch.zeros(1, dtype=torch.int64), exps)

    def py_calls(experts: int):
        """A CPU step of one Python-driven call of ``experts`` experts: i -> (experts, seconds)."""
        def step(i: int) -> tuple[int, float]:
            t = time.perf_counter()
            cpu_call(i, experts)
            return experts, time.perf_counter() - t
        return step

    def alone(cpu_step, steps: int) -> float:
        """GB/s of ``steps`` CPU steps (i -> (experts, seconds)) after one to warm up."""
        cpu_step(0)
        done = [cpu_step(i) for i in range(steps)]
        return sum(k for k, _ in done) * se / sum(dt for _, dt in done) / 1e9

    # best of two: the host is a shared VM whose CPU rate can dip for seconds at a time
    cpu8, cpu1 = max(alone(py_calls(8), 48) for _ in range(2)), max(alone(py_calls(1), 240) for _ in range(2))

    def concurrent(gpu_fn, reps: int, cpu_step, per: int = n) -> tuple[float, float]:
        """(GPU GB/s, CPU GB/s): queue ``reps`` GPU transfers of ``per`` experts, run CPU steps
        (i -> (experts, seconds)) until they end."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            gpu_fn()
        end.record()
        done, secs, i = 0, 0.0, 0
        while not end.query():
            k, dt = cpu_step(i)
            done, secs, i = done + k, secs + dt, i + 1
        end.synchronize()
        return per * se * reps / (start.elapsed_time(end) / 1e3) / 1e9, done * se / secs / 1e9

    pcie_c, cpu_c_dma = concurrent(dma, 120, py_calls(8))
    gat_c, cpu_c = concurrent(gather, 120, py_calls(8))
    gat_c1, cpu_c1 = max((concurrent(gather, 120, py_calls(1)) for _ in range(2)), key=lambda r: r[1])
    out = {"pcie_h2d_gbps": pcie, "gather_fill_gbps": gat, "gather_fill_gbps_1_fill_per_launch": gat1,
           "hbm_copy_gbps": hbm,
           "cpu_expert_gbps": cpu8, "cpu_expert_gbps_1_expert_calls": cpu1,
           "concurrent_pcie_h2d_gbps": pcie_c, "concurrent_cpu_expert_gbps_with_dma": cpu_c_dma,
           "concurrent_gather_fill_gbps": gat_c, "concurrent_cpu_expert_gbps": cpu_c,
           "concurrent_gather_fill_gbps_1_expert_cpu": gat_c1, "concurrent_cpu_expert_gbps_1_expert_calls": cpu_c1,
           "fill_fraction_python_calls": gat_c1 / (gat_c1 + cpu_c1), "expert_bytes": se}
    sized = 0.0            # the CPU's best rate by call size (from C only)
    if from_c:
        # q* from the CPU rate as the C++ branch sees it: the Python call around each 1-expert
        # call (15-20 us against ~100 us on the H200 host) made the CPU look slower and q* fill
        # more (0.47 where 0.3 decoded faster, bench/results/gpu_offload.json run I)
        cpu1_c = max(alone(c_calls, 30) for _ in range(2))
        gat_cc, cpu_cc = max((concurrent(gather, 120, c_calls) for _ in range(2)), key=lambda r: r[1])
        # both sides decode-sized: one fill per launch (a layer call fills 1-3), one expert per call
        gat1_cc, cpu1_cc = max((concurrent(gather1, 960, c_calls, 1) for _ in range(2)), key=lambda r: r[1])
        out.update({"cpu_expert_gbps_1_expert_calls_from_c": cpu1_c,
                    "concurrent_gather_fill_gbps_1_expert_cpu_from_c": gat_cc,
                    "concurrent_cpu_expert_gbps_1_expert_calls_from_c": cpu_cc,
                    "concurrent_gather_fill_gbps_1_fill_per_launch": gat1_cc,
                    "concurrent_cpu_expert_gbps_beside_1_fill_launches": cpu1_cc,
                    "fill_fraction_8_fill_launches": gat_cc / (gat_cc + cpu_cc)})
        gat_c1, cpu_c1 = gat1_cc, cpu1_cc
        out.update(call_size_rates(bank, x, concurrent, gather1, cpu1_cc))
        sized = max(out["cpu_call_size_gbps"].values())
    # the bound's rates: the larger of each side's concurrent measurements (the stricter bound),
    # the CPU's calls of 1-8 experts from C among them
    out.update({"fill_fraction": gat_c1 / (gat_c1 + cpu_c1),
                "fill_fraction_from": "1-fill gather launches beside C-driven 1-expert calls" if from_c
                else "8-fill gather launches beside Python 1-expert calls", "bound_pcie_gbps": max(pcie_c, gat_c, gat_c1),
                "bound_cpu_gbps": max(cpu_c_dma, cpu_c, cpu_c1, sized)})
    return out


def call_size_rates(bank: Bank, x: torch.Tensor, concurrent, gather1, one: float) -> dict:
    """The CPU kernel's rate by experts per call (2, 3, 4, 6, 8 distinct experts, one token, calls
    run back to back from C) beside 1-fill gather launches, as a decode step's CPU branch runs
    beside its fills, with ``one`` the 1-expert calls' rate measured the same way (the one q*'s
    fill fraction takes); -> ``cpu_call_size_gbps`` and the curve (kernels/split.py) that
    ``lru+q*`` passes to the control step (``lru+q*/flat``: none, every call at the 1-expert rate)."""
    from freetoken_engine.kernels import cpu_experts
    from freetoken_engine.kernels.split import speed_curve
    m = bank.model
    L, E = m["layers"], m["experts"]
    tok = torch.zeros(1, dtype=torch.int64)

    def sized(n: int):
        calls = max(2, 16 // n)

        def step(i: int) -> tuple[int, float]:
            layer = i % L
            first = 32 + (i // L * calls * n) % (E - 32 - calls * n)
            exps = torch.arange(first, first + calls * n).view(calls, n)
            return calls * n, cpu_experts.calls_seconds(x, bank.w13[layer], bank.w2[layer], tok.expand(n).contiguous(), exps)
        return step

    rates = {1: one, **{n: max(concurrent(gather1, 960, sized(n), 1)[1] for _ in range(2)) for n in (2, 3, 4, 6, 8)}}
    return {"cpu_call_size_gbps": {str(n): r for n, r in rates.items()}, "cpu_call_speed": list(speed_curve(rates))}
