"""The residual stream's fusions for the GPU decode: an MoE layer's combine in one launch (pair
selection, routing weights, the sum over k, the shared expert and the decoder's residual add),
and the attention's residual add fused into the next norm (``add_rms_norm``, from norm.py).

torch's path is two launches a layer with every expert on the device (the weights' multiply and
the sum over k; ``bench/engine_profile.py``: 7.2 us of a 48-layer step's layer) plus the residual
add, and with the CPU branch five more after its wait (the host rows' copy, a cumsum, a clamp, a
gather and a select): all of them on the critical path between the host's experts and the next
layer. Here the host rows are read straight from pinned memory (``.cv`` loads: fetched again on
every replay, the buffer is rewritten every layer).

Specification: ``reference.moe_combine_forward`` (the same rounding points: each weighted row
rounded to the data type, fp32 sum over k in order, rounded; then the shared expert's add and the
residual add, each rounded). torch's sum may add the k products in another order (fp32), so the
two agree to one rounding of the result. Tolerance (tests/engine/test_triton_combine.py): fp32
1e-6 relative; 16-bit 2^-7 of the largest output (2^-6 under Triton's interpreter, which
truncates instead of rounding).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import SplitRows
from ._common import next_pow2
from .norm import add_rms_norm, supported as norm_supported  # noqa: F401  (the add + norm of this family)

BLOCK_H = 1024          # columns per program: a few programs per token for Qwen-sized rows
MAX_SELECT_PAIRS = 1024  # a split's pairs are ranked inside each program


@triton.jit
def _combine_kernel(rows_ptr, w_ptr, slot_ptr, host_ptr, part_ptr, shared_ptr, res_ptr, out_ptr, P, H,
                    K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, SELECT: tl.constexpr,
                    PART: tl.constexpr, SHARED: tl.constexpr, RESIDUAL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    hm = h < H
    dt = out_ptr.dtype.element_ty
    if SELECT:      # host pairs take the next compact host row, in pair order
        q = tl.arange(0, BLOCK_P)
        slots = tl.load(slot_ptr + q, mask=q < P, other=0)
        ranks = tl.cumsum(((slots < 0) & (q < P)).to(tl.int32), 0) - 1
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):                       # fixed order over k
        p = t * K + j
        w = tl.load(w_ptr + p).to(tl.float32)
        if SELECT:
            on_host = tl.load(slot_ptr + p + h * 0) < 0                   # [BLOCK], one value
            rank = tl.sum(tl.where(q == p, ranks, 0), 0).to(tl.int64)
            gpu = tl.load(rows_ptr + p * H + h, mask=hm & ~on_host, other=0.0).to(tl.float32)
            cpu = tl.load(host_ptr + rank * H + h, mask=hm & on_host, other=0.0, cache_modifier=".cv")
            cpu = cpu.to(tl.float32)
            if PART:        # the streamed split's device rows of a host pair, added and rounded
                cpu = (cpu + tl.load(part_ptr + p * H + h, mask=hm & on_host, other=0.0).to(tl.float32))
                cpu = cpu.to(dt).to(tl.float32)
            row = tl.where(on_host, cpu, gpu)
        else:
            row = tl.load(rows_ptr + p * H + h, mask=hm, other=0.0).to(tl.float32)
        acc += (row * w).to(dt).to(tl.float32)
    out = acc.to(dt)
    if SHARED:
        out = (out.to(tl.float32) + tl.load(shared_ptr + t * H + h, mask=hm, other=0.0).to(tl.float32)).to(dt)
    if RESIDUAL:
        out = (tl.load(res_ptr + t * H + h, mask=hm, other=0.0).to(tl.float32) + out.to(tl.float32)).to(dt)
    tl.store(out_ptr + t * H + h, out, mask=hm)


def _flat(t: torch.Tensor | None) -> bool:
    return t is None or t.is_contiguous()


def supported(rows: torch.Tensor | SplitRows, weights: torch.Tensor, shared: torch.Tensor | None = None,
              residual: torch.Tensor | None = None) -> bool:
    """True when ``combine`` takes these arguments (else torch's ops: the reference)."""
    split = isinstance(rows, SplitRows)
    dense = rows.gpu if split else rows
    if weights.dim() != 2 or dense.dim() != 2 or dense.shape[0] != weights.numel() or weights.dtype != dense.dtype:
        return False
    if dense.dtype not in (torch.float32, torch.bfloat16, torch.float16) or dense.shape[1] == 0:
        return False
    extra = [shared, residual] + ([rows.host, rows.part] if split else [])
    if not all(_flat(a) and (a is None or a.dtype == dense.dtype) for a in [dense, weights, *extra]):
        return False
    if split and (rows.pair_slot.numel() != dense.shape[0] or rows.pair_slot.numel() > MAX_SELECT_PAIRS
                  or not rows.pair_slot.is_contiguous()):
        return False
    return True


def combine(rows: torch.Tensor | SplitRows, weights: torch.Tensor, shared: torch.Tensor | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """rows [T*k, H] (or ``SplitRows``), weights [T, k], shared / residual [T, H] or None ->
    [T, H] (see the module docstring). Call only where ``supported`` is True."""
    split = isinstance(rows, SplitRows)
    dense = rows.gpu if split else rows
    t, k = weights.shape
    h = dense.shape[1]
    out = torch.empty((t, h), dtype=dense.dtype, device=dense.device)
    if t:
        block = min(BLOCK_H, next_pow2(h))
        part = rows.part if split else None
        _combine_kernel[(t, triton.cdiv(h, block))](
            dense, weights, rows.pair_slot if split else weights, rows.host if split else dense,
            part if part is not None else dense, shared if shared is not None else dense,
            residual if residual is not None else dense, out, dense.shape[0], h,
            K=k, BLOCK=block, BLOCK_P=next_pow2(dense.shape[0]) if split else 1, SELECT=split,
            PART=part is not None, SHARED=shared is not None, RESIDUAL=residual is not None)
    return out
