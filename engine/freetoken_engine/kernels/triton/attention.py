"""Decode attention on the GPU: two launches per layer instead of about twenty-five torch ops.

The engine's GPU decode was op-bound (``bench/engine_profile.py``, H200, 48 layers in Qwen3-30B
shapes, every expert resident: 2,667 device operations per step, about 55 a layer, most of them
the attention's casts, copies, gathers and small matmuls). For one new token per sequence:

``_rope_write_kernel`` (one program per token and head): the per-head RMSNorm (Qwen3's q/k norm,
optional), the rotary embedding, and for each K/V head the write of K and V into the paged pool;
the rotated queries go to a scratch ``[T, h, d]``.

``_decode_attention_kernel`` (one program per sequence and KV head): its ``g`` query heads attend
over the keys ``kv_index[b, start:kv_len[b]]`` (start = kv_len - window with a sliding window, else
0) with an online softmax: each key block is gathered from the pool once for the group; scores
and the probability-weighted values are fp32 ``tl.dot``s (exact fp32 products: decode attention
reads K/V once and is bound by that, not by the arithmetic; Triton's interpreter also gets bf16
dots wrong).

Same contract as ``kernels/cpu/attention.py::decode_attention`` (the CPU's compiled call), and
the rounding points of the torch path in ``layers/attention.py`` up to the attention itself:
the normalised row rounded to the data type before the weight multiplies it, the rotary's two
products and their sum each rounded; scores are kept in fp32 (the torch path rounds them to the
data type before its fp32 softmax, and its probabilities before the second matmul), so bf16
results differ within bf16 noise. Tolerances
(tests/engine/test_triton_attention.py): fp32 ``1e-5``; bf16 ``2e-2`` of the largest output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_N = 64


@triton.jit
def _rope_write_kernel(qkv, qw, kw, cos, sin, slots, q_out, k_cache, v_cache, eps, row_stride,
                       H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0)
    hh = tl.program_id(1)                      # 0..H-1 query heads, then the KVH key heads (and V)
    dt = qkv.dtype.element_ty
    d = tl.arange(0, D)
    rolled = (d + D // 2) % D                  # rotate-half as a roll; the sin table is signed
    base = qkv + t * row_stride + hh * D
    x = tl.load(base + d).to(tl.float32)
    xr = tl.load(base + rolled).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        if hh < H:
            w = tl.load(qw + d).to(tl.float32)
            wr = tl.load(qw + rolled).to(tl.float32)
        else:
            w = tl.load(kw + d).to(tl.float32)
            wr = tl.load(kw + rolled).to(tl.float32)
        x = ((x * rstd).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        xr = ((xr * rstd).to(dt).to(tl.float32) * wr).to(dt).to(tl.float32)
    c = tl.load(cos + t * D + d).to(tl.float32)
    s = tl.load(sin + t * D + d).to(tl.float32)
    y = ((x * c).to(dt).to(tl.float32) + (xr * s).to(dt).to(tl.float32)).to(dt)
    if hh < H:
        tl.store(q_out + (t * H + hh) * D + d, y)
    else:
        slot = tl.load(slots + t)
        kh = hh - H
        tl.store(k_cache + (slot * KVH + kh) * D + d, y)
        v = tl.load(qkv + t * row_stride + (H + KVH + kh) * D + d)
        tl.store(v_cache + (slot * KVH + kh) * D + d, v)


@triton.jit
def _decode_attention_kernel(q_ptr, k_cache, v_cache, kv_index, kv_len, out_ptr, scale, window, idx_stride,
                             H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
                             D: tl.constexpr, BN: tl.constexpr, WINDOW: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    g = tl.arange(0, BG)
    d = tl.arange(0, D)
    gm = g < G
    rows = (b * H + kh * G + g)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + rows, mask=gm[:, None], other=0.0).to(tl.float32)
    n = tl.load(kv_len + b).to(tl.int32)
    start = n * 0
    if WINDOW:
        start = tl.maximum(n - window, 0)
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, D], tl.float32)
    for s0 in range(start, n, BN):
        offs = s0 + tl.arange(0, BN)
        km = offs < n
        slot = tl.load(kv_index + b * idx_stride + offs, mask=km, other=0)
        at = (slot[:, None] * KVH + kh) * D + d[None, :]
        k = tl.load(k_cache + at, mask=km[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_cache + at, mask=km[:, None], other=0.0).to(tl.float32)
        sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        sc = tl.where(km[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    tl.store(out_ptr + rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=gm[:, None])


def supported(x: torch.Tensor, k_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether ``decode_attention`` takes this layer: data and pool of one float dtype on one
    device, a contiguous ``[slots, kvh, d]`` pool, and a power-of-two head dim of at least 16."""
    return (x.dtype in DTYPES and k_cache.dtype == x.dtype and k_cache.device == x.device
            and k_cache.is_contiguous() and head_dim >= 16 and head_dim & (head_dim - 1) == 0)


def decode_attention(qkv: torch.Tensor, h: int, kvh: int, d: int, q_norm: torch.Tensor | None,
                     k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     kv_index: torch.Tensor, kv_len: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """qkv [T, (h + 2 kvh) d] of T decode tokens (token t is sequence t) -> attention output
    [T, h d]; writes the new K/V at ``slot_mapping`` first. ``q_norm`` / ``k_norm``: per-head
    RMSNorm weights [d] or None; cos / sin [T, 1, d] from ``Rotary.cos_sin``; kv_index [T, L]
    the pool slots of each sequence's keys, kv_len [T] how many it has after this token."""
    t = qkv.shape[0]
    if qkv.stride(-1) != 1 or t == 0:
        raise ValueError(f"qkv must be a non-empty row-major [T, (h + 2 kvh) d], got {tuple(qkv.shape)}")
    q = torch.empty((t, h, d), dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    w = q_norm if norm else qkv
    _rope_write_kernel[(t, h + kvh)](qkv, w, k_norm if norm else qkv, cos.contiguous(), sin.contiguous(),
                                     slot_mapping, q, k_cache, v_cache, float(eps), qkv.stride(0),
                                     H=h, KVH=kvh, D=d, NORM=norm)
    out = torch.empty((t, h * d), dtype=qkv.dtype, device=qkv.device)
    g = h // kvh
    _decode_attention_kernel[(t, kvh)](q, k_cache, v_cache, kv_index, kv_len, out, float(scale),
                                       int(window or 0), kv_index.stride(0), H=h, KVH=kvh, G=g,
                                       BG=max(16, next_pow2(g)), D=d, BN=BLOCK_N, WINDOW=window is not None)
    return out
