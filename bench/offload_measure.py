"""Measurements of ``bench/gpu_offload.py``: decode-kernel tile tuning, the control step's cost,
the per-token combine kernel, CUDA-graph capture and a decode row's bandwidth bound (the
bandwidths: ``offload_bandwidth.py``)."""
from __future__ import annotations


import numpy as np
import torch
import triton
import triton.language as tl

from offload_workload import CUDA, Bank  # first: it makes the engine package importable
from offload_bandwidth import events_seconds
from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.kernels.triton import moe as moe_mod
from freetoken_engine.kernels.triton.moe import moe_slots_forward

# ---------------------------------------------------------------------------------------------
# Kernel tuning and the control step's cost
# ---------------------------------------------------------------------------------------------
TILE_CANDIDATES = [
    {"bn1": 32, "bk1": 128, "bn2": 64, "bk2": 128, "warps": 4},
    {"bn1": 16, "bk1": 256, "bn2": 32, "bk2": 256, "warps": 4},
    {"bn1": 64, "bk1": 64, "bn2": 64, "bk2": 64, "warps": 4},
    {"bn1": 32, "bk1": 256, "bn2": 64, "bk2": 256, "warps": 8},
]


def tune_decode(model: dict) -> dict:
    """Time moe_slots_forward for batch 1 and 4 (8 different expert sets per graph, so weights
    come from HBM, not L2) for each tile candidate; set the fastest as DECODE_TILES."""
    H, I, k = model["hidden"], model["inter"], model["top_k"]
    n_slots = 64
    pool13 = (torch.randn(n_slots, 2 * I, H, device=CUDA) * 0.02).to(torch.bfloat16)
    pool2 = (torch.randn(n_slots, H, I, device=CUDA) * 0.02).to(torch.bfloat16)
    rows = []
    for tiles in TILE_CANDIDATES:
        moe_mod.DECODE_TILES = tiles
        row = {"tiles": tiles}
        for batch in (1, 4):
            x = torch.randn(batch, H, device=CUDA).to(torch.bfloat16)
            tok = torch.arange(batch, device=CUDA).repeat_interleave(k)
            calls = [torch.stack([torch.randperm(n_slots, device=CUDA)[:k] for _ in range(batch)]).flatten()
                     for _ in range(8)]
            out = torch.empty(batch * k, H, dtype=torch.bfloat16, device=CUDA)
            run = lambda: [moe_slots_forward(x, pool13, pool2, tok, ps, out=out) for ps in calls]  # noqa: E731
            run()
            graph = _capture(run)
            secs = events_seconds(graph.replay, 10) / 80
            distinct = sum(len(set(ps.tolist())) for ps in calls) / len(calls)
            row[f"us_batch{batch}"] = secs * 1e6
            row[f"gbps_batch{batch}"] = distinct * model["expert_bytes"] / secs / 1e9
        rows.append(row)
    best = min(rows, key=lambda r: r["us_batch1"] + r["us_batch4"])
    moe_mod.DECODE_TILES = best["tiles"]
    return {"candidates": rows, "chosen": best["tiles"]}


def control_step_us(bank: "Bank", slots: int) -> float:
    """Microseconds per control step (one MoE layer, batch 1) at a pool of ``slots``, graph-replayed."""
    m = bank.model
    L, E, k = m["layers"], m["experts"], m["top_k"]
    dummy13 = torch.empty((1, *bank.w13.shape[2:]), dtype=torch.bfloat16, device=CUDA)
    dummy2 = torch.empty((1, *bank.w2.shape[2:]), dtype=torch.bfloat16, device=CUDA)
    minus = lambda n: torch.full((n,), -1, dtype=torch.int64, device=CUDA)  # noqa: E731
    ctl = DeviceControl(bank.w13, bank.w2, dummy13, dummy2, minus(L * E).view(L, E), minus(slots), minus(slots), 0, 1.0)
    ids = torch.rand(L, 1, E, device=CUDA).topk(k, dim=-1).indices
    run = lambda: [ctl.step(l, ids[l], copy=False) for l in range(L)]  # noqa: E731
    run()
    graph = _capture(run)
    return events_seconds(graph.replay, 5) / (5 * L) * 1e6


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------
class _Token:
    """Static buffers of one decode configuration (stable addresses for CUDA graphs)."""

    def __init__(self, bank: Bank, batch: int):
        m = bank.model
        self.T, self.k, self.L, self.E, self.H = batch, m["top_k"], m["layers"], m["experts"], m["hidden"]
        self.bank = bank
        self.P = batch * self.k
        self.tok = torch.arange(batch, device=CUDA).repeat_interleave(self.k)
        self.h_tok = self.tok.cpu()
        self.x = torch.zeros(self.L + 1, batch, self.H, dtype=torch.bfloat16, device=CUDA)
        self.x[0].copy_(torch.randn(batch, self.H))
        self.rows = torch.zeros(self.L, self.P, self.H, dtype=torch.bfloat16, device=CUDA)
        self.ids = torch.zeros(self.L, batch, self.k, dtype=torch.int64, device=CUDA)
        self.shared_tok = torch.arange(batch, device=CUDA)
        self.shared_slot = [torch.full((batch,), l, dtype=torch.int64, device=CUDA) for l in range(self.L)]

    def load_ids(self, ids_dev: torch.Tensor, ids_host: torch.Tensor, t: int) -> None:
        """Token t's routing: a device-to-device copy in stream order (a pinned staging buffer
        rewritten by the host would race the graphs still queued); the host side reads its own
        copy of the routing."""
        self.ids.copy_(ids_dev[t])

    def combine(self, layer: int, rows: torch.Tensor) -> None:
        """x[l+1] = RMS-normalised sum over k of the pair rows (+ the shared expert)."""
        shared = None
        if self.bank.shared is not None:
            s13, s2 = self.bank.shared
            shared = moe_slots_forward(self.x[layer], s13, s2, self.shared_tok, self.shared_slot[layer])
        combine(rows, shared, self.x[layer + 1], self.k)


@triton.jit
def _combine_kernel(rows_ptr, rows2_ptr, rows3_ptr, host_rows_ptr, ps_ptr, add_ptr, x_ptr, xh_ptr, P,
                    K: tl.constexpr, H: tl.constexpr, BLOCK_P: tl.constexpr, SELECT: tl.constexpr,
                    HAS_ADD: tl.constexpr, MIRROR: tl.constexpr, TWO: tl.constexpr, THREE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H)
    acc = tl.zeros([H], dtype=tl.float32)
    if SELECT:      # CPU pairs (pair_slot < 0) take the next compact host row, in pair order
        q = tl.arange(0, BLOCK_P)
        ps_all = tl.load(ps_ptr + q, mask=q < P, other=0)
        rank_all = tl.cumsum(((ps_all < 0) & (q < P)).to(tl.int32), 0) - 1
    for j in tl.static_range(K):                       # fixed order over k
        p = t * K + j
        gpu = tl.load(rows_ptr + p * H + h).to(tl.float32)   # a zero row for a CPU pair
        if TWO:                                            # hits and fills in two buffers, zero elsewhere
            gpu += tl.load(rows2_ptr + p * H + h).to(tl.float32)
        if THREE:                                          # a streamed split's GPU part of a CPU pair
            gpu += tl.load(rows3_ptr + p * H + h).to(tl.float32)
        if SELECT:
            ps = tl.load(ps_ptr + p + h * 0)                      # [H], one value
            rank = tl.sum(tl.where(q == p, rank_all, 0), 0).to(tl.int64)
            # .cv: fetch the host's rows again each time (the buffer is rewritten every layer)
            cpu = tl.load(host_rows_ptr + rank * H + h, mask=ps < 0, other=0.0, cache_modifier=".cv")
            acc += gpu + cpu.to(tl.float32)                # one is zero, or both parts of a split pair
        else:
            acc += gpu
    if HAS_ADD:
        acc += tl.load(add_ptr + t * H + h).to(tl.float32)
    acc = acc * tl.rsqrt(tl.sum(acc * acc, 0) / H + 1e-6)
    tl.store(x_ptr + t * H + h, acc.to(x_ptr.dtype.element_ty))
    if MIRROR:
        tl.store(xh_ptr + t * H + h, acc.to(x_ptr.dtype.element_ty))


def combine(rows: torch.Tensor, shared: torch.Tensor | None, x: torch.Tensor, k: int,
            pair_slot: torch.Tensor | None = None, host_rows: torch.Tensor | None = None,
            x_host: torch.Tensor | None = None, rows2: torch.Tensor | None = None,
            rows3: torch.Tensor | None = None) -> torch.Tensor:
    """x = rmsnorm(sum_j row[t*k + j] (+ shared[t])): what stands in for the rest of the layer
    (one kernel; the non-expert compute itself is excluded). With ``pair_slot``/``host_rows``:
    pair p's row is rows[p] when pair_slot[p] >= 0, else the next row of ``host_rows`` (compact,
    in pair order; pinned host memory, read by the kernel directly). ``x_host``: a pinned copy of x.
    ``rows2``: a second buffer of GPU rows added to ``rows`` (hits and fills computed apart, each
    zero where the other has a row: the sum is the row, exactly). ``rows3``: the GPU part of the
    streamed split's CPU pairs (zero elsewhere), added to their host rows."""
    t, h = x.shape
    select = pair_slot is not None
    _combine_kernel[(t,)](rows, rows2 if rows2 is not None else rows, rows3 if rows3 is not None else rows,
                          host_rows if select else rows,
                          pair_slot if select else rows,
                          shared if shared is not None else rows, x, x_host if x_host is not None else x,
                          rows.shape[0], K=k, H=h,
                          # constexpr only where used: a prefill of a new length must not recompile
                          BLOCK_P=triton.next_power_of_2(rows.shape[0]) if select else 1,
                          SELECT=select, HAS_ADD=shared is not None, MIRROR=x_host is not None,
                          TWO=rows2 is not None, THREE=rows3 is not None)
    return x


def _capture(fn) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def row_bound(bank, policy, slots, d_meas, ctl, before, counts, bw, steps, batch, secs, extra_misses: float = 0.0) -> dict:
    """The bandwidth-model bound of a row from its measured counts (see gpu_offload's docstring).
    ``extra_misses``: experts moved outside the steps' own misses (a prefetch's copies), counted
    as misses in the bound."""
    m = bank.model
    L, E, se = m["layers"], m["experts"], m["expert_bytes"]
    hbm, pcie, cpu_b = bw["hbm_copy_gbps"] * 1e9, bw["pcie_h2d_gbps"] * 1e9, bw["cpu_expert_gbps"] * 1e9
    shared_t = L * bank.shared_bytes / hbm
    out = {}
    if policy in ("all", "static", "static/graph"):
        n_gpu = slots // E
        on_cpu = float(d_meas[:, n_gpu:].sum())                 # distinct experts of the CPU layers
        bound = (float(d_meas[:, :n_gpu].sum()) * se / hbm + on_cpu * se / cpu_b) / steps
        if ctl is not None:        # static/graph: the control made (b)'s choices, nothing else
            c = {key: v - before[key] for key, v in ctl.counters().items()}
            if c["fills"] or c["cpu_computed"] != on_cpu:
                raise RuntimeError(f"static/graph: the control step left the static split: {c}")
        out.update(miss_rate=on_cpu / float(d_meas.sum()), fills_per_step=0.0,
                   cpu_experts_per_step=on_cpu / steps, gpu_layers=n_gpu)
    else:
        after = ctl.counters()
        c = {key: after[key] - before[key] for key in after}
        c["misses"] += extra_misses
        if policy in ("lru", "lru+sync"):
            bound = (c["fills"] * se / pcie + (c["hits"] + c["fills"]) * se / hbm) / steps
        else:
            # misses split ideally (as if divisible) between PCIe and the CPU, both at their
            # rates measured while the other runs (the larger of each side's measurements)
            bp, bc = bw["bound_pcie_gbps"] * 1e9, bw["bound_cpu_gbps"] * 1e9
            bound = (c["misses"] * se / (bp + bc) + (c["hits"] + c["fills"]) * se / hbm) / steps
            cnt = np.stack(counts).reshape(-1, 4).astype(np.float64)        # [steps * L, 4]
            miss, fills = cnt[:, 1], cnt[:, 2]
            q = np.arange(int(miss.max()) + 1)[None, :] if miss.size else np.zeros((1, 1))
            best = np.where(q <= miss[:, None], np.maximum(q * se / bp, (miss[:, None] - q) * se / bc), np.inf)
            gpu_t = (cnt[:, 0] + fills) * se / hbm
            integer = float((best.min(1) + gpu_t).sum() / steps + shared_t)
            actual = float((np.maximum(fills * se / bp, cnt[:, 3] * se / bc) + gpu_t).sum() / steps + shared_t)
            out.update(bound_integer_split_tok_s=batch / integer, fraction_of_integer_split_bound=integer / secs,
                       bound_actual_split_tok_s=batch / actual, fraction_of_actual_split_bound=actual / secs,
                       misses_per_layer_call_hist=np.bincount(miss.astype(int)).tolist())
        out.update(miss_rate=c["misses"] / max(c["hits"] + c["misses"], 1), fills_per_step=c["fills"] / steps,
                   cpu_experts_per_step=c["cpu_computed"] / steps, fill_fraction=ctl.fill_fraction)
    bound = float(bound) + shared_t
    out.update(bound_tok_s=batch / bound, fraction_of_bound=bound / secs)
    return out
