"""The same-process A/B sides of bench/engine_gpu_decode.py (``graphs/*-ab``) and the timing of
one side's decode (``timed``): per budget and batch, rounds of both arms of a switch, each arm
after the same fill fraction with its own graphs captured in its warm-up steps."""
from __future__ import annotations

import json
import os
import time


def _hits_ab(llm, Lockstep, fractions: list[float], batches: list[int], steps: int, q: float) -> list[dict]:
    """Side graphs/hits-ab: rows "hits beside fills" and "hits after fills" (``_ab``)."""
    from freetoken_engine.cache.device_control import DeviceControl

    def overlap(on: bool) -> None:
        DeviceControl.overlap_hits = on
    return _ab(llm, Lockstep, fractions, batches, steps, q, overlap, ("hits beside fills", "hits after fills"))


def _gemv_ab(llm, Lockstep, fractions: list[float], batches: list[int], steps: int, q: float) -> list[dict]:
    """Side graphs/gemv-ab: rows "triton gemv" and "cublas gemv" (``_ab``): the dense projections
    of a decode step through kernels/triton/gemv.py, or torch's F.linear (FREETOKEN_GPU_DECODE_KERNELS
    without "gemv", the engine before 2026-11-30's twenty-first session)."""
    from freetoken_engine import env
    from freetoken_engine.kernels import gpu_decode_kernels

    def triton(on: bool) -> None:
        os.environ[env.FREETOKEN_GPU_DECODE_KERNELS] = "on" if on else ",".join(
            k for k in env.GPU_DECODE_KERNELS if k != "gemv")
        gpu_decode_kernels.cache_clear()
    return _ab(llm, Lockstep, fractions, batches, steps, q, triton, ("triton gemv", "cublas gemv"), warm=True)


def _control_ab(llm, Lockstep, fractions: list[float], batches: list[int], steps: int, q: float) -> list[dict]:
    """Side graphs/control-ab: rows "control skips" (a control step without a miss skips its
    pool-wide scan, kernels/triton/control.py ``SKIP_WITHOUT_MISSES``) and "control scans" (every
    call scans, the engine before 2026-11-30's twenty-first session)."""
    from freetoken_engine.kernels.triton import control

    def skip(on: bool) -> None:
        control.SKIP_WITHOUT_MISSES = on
    return _ab(llm, Lockstep, fractions, batches, steps, q, skip, ("control skips", "control scans"), warm=True)


def _moe_lanes_ab(llm, Lockstep, fractions: list[float], batches: list[int], steps: int, q: float) -> list[dict]:
    """Side graphs/moe-lanes-ab: rows "moe lanes" (a one-token call's routed experts through the
    lanes kernels, kernels/triton/moe.py ``LANES_TILES``) and "moe tiled" (through the tiled
    kernels of every other call, as before 2026-12-04's forty-eighth stop)."""
    from freetoken_engine.kernels.triton import moe
    lanes = moe.LANES_TILES

    def switch(on: bool) -> None:
        moe.LANES_TILES = lanes if on else None
    return _ab(llm, Lockstep, fractions, batches, steps, q, switch, ("moe lanes", "moe tiled"), warm=True)


def _ab(llm, Lockstep, fractions: list[float], batches: list[int], steps: int, q: float, switch,
        names: tuple[str, str], rounds: int = 2, warm: bool = False) -> list[dict]:
    """A same-process A/B: per budget and batch, ``rounds`` x (``switch(True)``: row names[0],
    ``switch(False)``: row names[1]), each after ``set_fill_fraction(q)`` and with the graphs
    dropped (the same q; each timing captures its own graphs in its warm-up steps). ``warm``: one
    untimed timing first (the cache filling under the replayed routing), and every other round
    in the order B, A, so neither side always runs on the fuller cache."""
    runner, rows = llm.runner, []
    for frac in fractions:
        runner.resize_expert_cache(max(1, round(frac * runner.bank.total_experts)))
        for b in batches:
            if warm:
                timed(llm, Lockstep, "warm-up", frac, b, steps)
            for r in range(rounds):
                arms = list(zip((True, False), names))
                for on, name in (arms[::-1] if warm and r % 2 else arms):
                    switch(on)
                    runner.set_fill_fraction(q)           # (it also drops the captured graphs)
                    rows.append(timed(llm, Lockstep, name, frac, b, steps))
                    print(json.dumps(rows[-1]), flush=True)
    switch(True)
    return rows




def _threshold_ab(llm, Lockstep, fractions: list[float], batches: list[int], steps: int, q: float) -> list[dict]:
    """Side graphs/threshold-ab: rows "cache path" (decode batches below the engine's
    prefill_expert_threshold, 33, go through the expert cache and its decode graphs) and
    "whole layers from 16" (the threshold of 16 before 2026-11-30's twenty-second session: a
    batch of 16+ tokens ran the prefill's whole-layer path, eagerly)."""
    runner = llm.runner
    new = runner.experts.prefill_threshold

    def cache_path(on: bool) -> None:
        runner.experts.prefill_threshold = new if on else 16
        if runner.graphs is not None:
            runner.graphs.max_batch = min(runner.cfg.max_batch, runner.experts.prefill_threshold - 1)
    return _ab(llm, Lockstep, fractions, batches, steps, q, cache_path, ("cache path", "whole layers from 16"),
               warm=True)


def timed(llm, Lockstep, side: str, frac: float, b: int, steps: int) -> dict:
    """24 warm-up steps (fills, captures), then ``steps`` timed lockstep decode steps of b prompts."""
    runner = llm.runner
    batch = Lockstep(llm, [[(37 * i + 11 * t) % 31000 + 100 for t in range(32)] for i in range(b)])
    for _ in range(24):
        batch.step()
    before = runner.expert_stats()
    ctl = getattr(runner.experts, "control", None)
    pf_before = ctl.prefetch_counters() if ctl is not None else None
    t0 = time.perf_counter()
    marks = [t0]
    for _ in range(steps):
        batch.step()
        marks.append(time.perf_counter())
    secs = marks[-1] - t0
    step_ms = sorted(1e3 * (b - a) for a, b in zip(marks, marks[1:]))
    after = runner.expert_stats()
    batch.close()
    d = {k: after[k] - before[k] for k in ("hits", "misses", "fills", "cpu_computed")}
    # cross-layer prefetch (FREETOKEN_EXPERT_PREFETCH): its fills crossed PCIe too
    pf = {k: v - pf_before[k] for k, v in ctl.prefetch_counters().items()} if ctl is not None else {}
    graphs = runner.graphs
    return {**({"prefetch_fills_per_step": pf["fills"] / steps, "prefetch_hits_per_step": pf["hits"] / steps,
                "prefetch_misses_per_step": pf["misses"] / steps} if pf else {}),"side": side, "cache_fraction": frac, "cache_experts": runner.cache.capacity,
            "batch": b, "steps": steps, "tok_s": b * steps / secs, "ms_per_step": 1e3 * secs / steps,
            # the spread of single steps: a few stalled steps against a uniformly slower decode
            "step_ms_min": step_ms[0], "step_ms_median": step_ms[len(step_ms) // 2], "step_ms_max": step_ms[-1],
            "miss_rate": d["misses"] / max(d["hits"] + d["misses"], 1),
            "cpu_experts_per_step": d["cpu_computed"] / steps, "fills_per_step": d["fills"] / steps,
            "fill_fraction": after["fill_fraction"],
            "graph_replays": graphs.replays if graphs is not None else 0}


AB_SIDES = {"graphs/hits-ab": _hits_ab, "graphs/gemv-ab": _gemv_ab, "graphs/control-ab": _control_ab,
            "graphs/threshold-ab": _threshold_ab, "graphs/moe-lanes-ab": _moe_lanes_ab}
