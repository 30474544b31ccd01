"""The split by stage's GPU part: the down projection of CPU experts from the host's activations.

A partial expert does not fit the bank's layout (``bench/cpu_partial_rows.py``: the CPU reads
W2's rows whole whatever share of them it needs), a whole stage does. For the first n CPU experts
of a layer (``control.py``, ``StreamSplit.stage``) the GPU copies their whole W2 (a third of an
expert) into scratch slots (``stream.py``) while the host computes their activations
``silu(W1 x) * (W3 x)`` first (``cpu_experts.experts_act``) and publishes them in pinned memory;
after a device wait on that flag, ``stage_down_forward`` computes ``y[p] = W2[s] act[p]`` for every
pair p with scratch slot s = ``pair_stream[p]`` >= 0 and a zero row for the others, which the
combine adds to the host's zero row of that pair.

Arithmetic: fp32 products and sums over I in blocks, rounded once to the output dtype (the CPU
kernel's stage 2 sums in another order): within 1e-5 relative in fp32 and a bf16 rounding of the
largest output in bf16 (tests/engine/test_stage_split.py). The activations are read with ``.cv``
loads (pinned memory rewritten every layer).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_tensor, next_pow2

BLOCK_H = 64
BLOCK_I = 128


@triton.jit
def _stage_down_kernel(act_ptr, w2_ptr, stream_ptr, out_ptr, H, I,
                       BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    s = tl.load(stream_ptr + p).to(tl.int64)
    acc = tl.zeros([BLOCK_H], tl.float32)
    if s >= 0:
        for i0 in range(0, I, BLOCK_I):
            i = i0 + tl.arange(0, BLOCK_I)
            im = i < I
            a = tl.load(act_ptr + p * I + i, mask=im, other=0.0, cache_modifier=".cv").to(tl.float32)
            w = tl.load(w2_ptr + s * H * I + h[:, None] * I + i[None, :], mask=hm[:, None] & im[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], 1)
    tl.store(out_ptr + p * H + h, acc.to(out_ptr.dtype.element_ty), mask=hm)


def stage_down_forward(act: torch.Tensor, w2: torch.Tensor, pair_stream: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """``[P, H]``: row p = ``w2[pair_stream[p]] @ act[p]`` where pair_stream[p] >= 0, else zeros.

    act [>= P, I] (pinned host memory or on w2's device; its first P rows are read), w2 [S, H, I]
    on the device, pair_stream [P] integer on the device; ``out`` [P, H] on the device (stable
    address for graphs). One dtype for act, w2 and out. Raises ValueError on bad shapes."""
    dev = w2.device
    check_tensor("pair_stream", pair_stream, 1, (torch.int32, torch.int64), dev)
    if w2.dim() != 3 or act.dim() != 2 or act.shape[1] != w2.shape[2] or act.shape[0] < pair_stream.numel():
        raise ValueError(f"act [>= P, I] and w2 [S, H, I] expected, got {tuple(act.shape)}, {tuple(w2.shape)} "
                         f"for P={pair_stream.numel()}")
    if act.dtype != w2.dtype or not act.is_contiguous() or not w2.is_contiguous():
        raise ValueError("act and w2 must be contiguous and of one dtype")
    P, H, I = pair_stream.numel(), w2.shape[1], w2.shape[2]
    if out is None:
        out = torch.empty((P, H), dtype=w2.dtype, device=dev)
    elif tuple(out.shape) != (P, H) or out.dtype != w2.dtype or out.device != dev or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{P}, {H}] {w2.dtype} tensor on {dev}")
    if P:
        _stage_down_kernel[(P, triton.cdiv(H, BLOCK_H))](
            act, w2, pair_stream, out, H, I, BLOCK_H=BLOCK_H, BLOCK_I=min(BLOCK_I, next_pow2(I)))
    return out
