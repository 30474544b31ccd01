"""The one-token MoE kernels (moe.py's ``lanes``: a batch-1 decode call) and the gate activation
that every MoE kernel applies.

Each pair is its own expert, so a program owns a few weight rows of one pair (``moe.LANES_TILES``;
``moe.LANES_TILES_MX`` on MXFP4 slots) and multiplies elementwise in fp32, reducing once after the
K loop, as ``gemv.py``'s one-token kernel does. MXFP4 slots are decoded as ``moe_mxfp4.py`` says,
a block at a time, against the token's row in their byte order: each block's 32 products are
summed before its scale multiplies them once.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .moe_mxfp4 import inter_pos, mx_acts, mx_block_sums, mx_rows_f16


@triton.jit
def gated(g, u, alpha, clamp, ACT: tl.constexpr):
    """The activation of float32 gate and up rows: silu(g) u (ACT 0) or gpt-oss's clamped gate
    (ACT 1: reference.GatedAct "swiglu_oai")."""
    if ACT == 1:
        gc = tl.minimum(g, clamp)
        uc = tl.minimum(tl.maximum(u, -clamp), clamp)
        h = (uc + 1.0) * (gc / (1.0 + tl.exp(-(gc * alpha))))
    else:
        h = g / (1.0 + tl.exp(-g)) * u
    return h


@triton.jit
def gate_up_lanes_kernel(x_ptr, w13_ptr, inter_ptr, pair_slot_ptr, limit_ptr, b13_ptr, pair_bias_ptr, alpha, clamp,
                          H, I, stride_ws, stride_wn, stride_b,
                          BN: tl.constexpr, BK: tl.constexpr, LIMIT: tl.constexpr, ACT: tl.constexpr,
                          BIAS: tl.constexpr, MX: tl.constexpr):
    """One token: program (p, j) computes intermediate rows [j BN, (j + 1) BN) of pair p,
    multiplying elementwise in fp32 and reducing each row once, after the K loop."""
    p = tl.program_id(0)
    s = tl.load(pair_slot_ptr + p).to(tl.int64)
    lim = I
    if LIMIT:
        lim = tl.minimum(tl.load(limit_ptr).to(tl.int32), I)
    if (s >= 0) & (tl.program_id(1) * BN < lim):
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < lim
        gate = w13_ptr + s * stride_ws + n.to(tl.int64) * stride_wn                     # [BN]
        up = gate + I * stride_wn
        if MX:          # x in byte order (moe_mxfp4.py), BK / 2 code bytes a step
            acc_g = tl.zeros([BN, BK // 32], dtype=tl.float32)
            acc_u = tl.zeros([BN, BK // 32], dtype=tl.float32)
            for k0 in range(0, H // 2, BK // 2):
                xl, xh = mx_acts(x_ptr, k0, H, BK // 32)
                gl, gh, gs = mx_rows_f16(gate, k0, H, nmask, BK // 32)
                ul, uh, us = mx_rows_f16(up, k0, H, nmask, BK // 32)
                acc_g += mx_block_sums(gl, gh, xl, xh, gs)
                acc_u += mx_block_sums(ul, uh, xl, xh, us)
        else:
            acc_g, acc_u = tl.zeros([BN, BK], dtype=tl.float32), tl.zeros([BN, BK], dtype=tl.float32)
            for k0 in range(0, H, BK):
                k = k0 + tl.arange(0, BK)
                kmask = k < H
                xk = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
                wmask = nmask[:, None] & kmask[None, :]
                acc_g += tl.load(gate[:, None] + k[None, :], mask=wmask, other=0.0).to(tl.float32) * xk
                acc_u += tl.load(up[:, None] + k[None, :], mask=wmask, other=0.0).to(tl.float32) * xk
        g, u = tl.sum(acc_g, 1), tl.sum(acc_u, 1)
        if BIAS:
            b = b13_ptr + tl.load(pair_bias_ptr + p).to(tl.int64) * stride_b
            g += tl.load(b + n, mask=nmask, other=0.0).to(tl.float32)
            u += tl.load(b + I + n, mask=nmask, other=0.0).to(tl.float32)
        h = gated(g, u, alpha, clamp, ACT)                                 # float32
        col = inter_pos(n, I) if MX else n                  # MX: in the down rows' byte order
        tl.store(inter_ptr + p * I + col, h.to(inter_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def down_lanes_kernel(inter_ptr, w2_ptr, out_ptr, pair_slot_ptr, limit_ptr, H, I, stride_ws, stride_wn, stride_ot,
                       BN: tl.constexpr, BK: tl.constexpr, LIMIT: tl.constexpr, MX: tl.constexpr):
    """One token: program (p, j) computes output rows [j BN, (j + 1) BN) of pair p."""
    p = tl.program_id(0)
    s = tl.load(pair_slot_ptr + p).to(tl.int64)
    lim = I
    if LIMIT:
        lim = tl.minimum(tl.load(limit_ptr).to(tl.int32), I)
    if s >= 0:
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < H
        rows = w2_ptr + s * stride_ws + n.to(tl.int64) * stride_wn                      # [BN]
        if MX:          # the intermediate row in byte order (the gate/up kernel wrote it so)
            acc = tl.zeros([BN, BK // 32], dtype=tl.float32)
            for k0 in range(0, I // 2, BK // 2):
                al, ah = mx_acts(inter_ptr + p * I, k0, I, BK // 32)
                wl, wh, ws = mx_rows_f16(rows, k0, I, nmask, BK // 32)
                acc += mx_block_sums(wl, wh, al, ah, ws)
        else:
            acc = tl.zeros([BN, BK], dtype=tl.float32)
            for k0 in range(0, lim, BK):
                k = k0 + tl.arange(0, BK)
                kmask = k < lim
                a = tl.load(inter_ptr + p * I + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
                w = tl.load(rows[:, None] + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
                acc += w.to(tl.float32) * a
        tl.store(out_ptr + p * stride_ot + n, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=nmask)
