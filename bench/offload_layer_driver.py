"""The per-layer launch driver of ``bench/offload_decode.py``'s ``lru+q*/layer`` and ``lru+sync``
rows: the CPU branch driven from Python, one layer at a time, kept for A/B rows against the
one-graph-per-token driver that replaced it.

The per-layer driver, per MoE layer l, as the host sees it:

    seg1(l-1): combine(l-1) -> control(l) [pair slots and counts mirrored into pinned memory]
    event(l)                                  <- the host waits here
    seg2(l):   fills(l) (gather kernel) -> GPU experts(l) -> shared expert(l)
    host:      experts of layer l with pair_slot < 0 on the CPU (the engine's CPU expert
               kernel), rows written compactly into pinned memory; then seg1(l) is launched,
               whose combine reads those rows straight from pinned memory.

seg1 and seg2 are CUDA graphs (two launches and one event per layer); the host wait overlaps
the fills and the GPU experts, so when a layer has no CPU work the GPU never waits for the host.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from offload_workload import CUDA, Bank  # first: it makes the engine package importable
from offload_measure import _capture, _Token, combine
from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.kernels.triton.gather import gather_fill_rows
from freetoken_engine.kernels.triton.moe import moe_slots_forward


class CpuBranchBuffers:
    """Host buffers of the CPU branch (pinned; read or written by kernels through UVA)."""

    def __init__(self, st: _Token):
        L, P, T, H = st.L, st.P, st.T, st.H
        self.ps = torch.zeros(L, P, dtype=torch.int64).pin_memory()          # pair slots per layer
        self.counts = torch.zeros(L, 4, dtype=torch.int64).pin_memory()      # hits, misses, fills, cpu
        self.x = torch.zeros(L, T, H, dtype=torch.bfloat16).pin_memory()     # layer inputs
        self.rows = torch.zeros(P, H, dtype=torch.bfloat16).pin_memory()     # compact CPU rows
        self.ps_np, self.counts_np = self.ps.numpy(), self.counts.numpy()
        self.x[0].copy_(st.x[0])
        self.gpu_rows = torch.zeros(P, H, dtype=torch.bfloat16, device=CUDA)
        self.shared = torch.zeros(L, T, H, dtype=torch.bfloat16, device=CUDA)
        self.ev = [torch.cuda.Event() for _ in range(L)]


def layer_driver_token(bank: Bank, st: _Token, ctl: DeviceControl, cpu_fn, prof: dict):
    """Segments and the per-token driver of the CPU-branch policies (the module docstring)."""
    L, P = st.L, st.P
    br = CpuBranchBuffers(st)
    w13s, w2s = ctl.w13_slots, ctl.w2_slots

    def control(l):
        ctl.step(l, st.ids[l], copy=False, mirror=(br.ps[l], br.counts[l]))

    def seg2(l):
        out = ctl.outputs(P)
        gather_fill_rows(bank.w13, bank.w2, w13s, w2s, l, out.fill_exp, out.fill_slot)
        moe_slots_forward(st.x[l], w13s, w2s, st.tok, out.pair_slot, out=br.gpu_rows)
        if bank.shared is not None:
            s13, s2 = bank.shared
            moe_slots_forward(st.x[l], s13, s2, st.shared_tok, st.shared_slot[l], out=br.shared[l])

    def seg1(l):
        combine(br.gpu_rows, br.shared[l] if bank.shared is not None else None, st.x[l + 1], st.k,
                pair_slot=ctl.outputs(P).pair_slot, host_rows=br.rows,
                x_host=br.x[l + 1] if l + 1 < L else None)
        if l + 1 < L:
            control(l + 1)

    h_tok = st.h_tok.numpy()

    def token(graphs, h_ids: np.ndarray):
        run = (lambda name, l: graphs[name][l].replay()) if graphs else \
              (lambda name, l: (control(0) if name == "start" else (seg1 if name == "seg1" else seg2)(l)))
        run("start", 0)
        br.ev[0].record()
        run("seg2", 0)
        for l in range(L):
            t0 = time.perf_counter()
            br.ev[l].synchronize()                       # control(l) done, its mirror readable
            t1 = time.perf_counter()
            idx = np.flatnonzero(br.ps_np[l] < 0)
            if idx.size:
                # out=: the kernel writes the pinned rows itself (a torch copy of 16+ rows runs
                # on torch's OpenMP threads, which then spin on the kernel's CPUs)
                cpu_fn(br.x[l], bank.w13[l], bank.w2[l], torch.from_numpy(h_tok[idx]),
                       torch.from_numpy(h_ids[l].reshape(-1)[idx]), out=br.rows[:idx.size])
            t2 = time.perf_counter()
            run("seg1", l)
            if l + 1 < L:
                br.ev[l + 1].record()
                run("seg2", l + 1)
            t3 = time.perf_counter()
            for key, v in (("wait", t1 - t0), ("cpu", t2 - t1), ("launch", t3 - t2), ("cpu_layers", bool(idx.size))):
                prof[key] += v

    def capture():
        return {"start": [_capture(lambda: control(0))],
                "seg1": [_capture(lambda l=l: seg1(l)) for l in range(L)],
                "seg2": [_capture(lambda l=l: seg2(l)) for l in range(L)]}

    return token, capture, br
