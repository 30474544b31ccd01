"""Decode attention on the GPU: two launches per layer instead of about twenty-five torch ops.

The engine's GPU decode was op-bound (``bench/engine_profile.py``, H200, 48 layers in Qwen3-30B
shapes, every expert resident: 2,667 device operations per step, about 55 a layer, most of them
the attention's casts, copies, gathers and small matmuls). For one new token per sequence:

``_rope_write_kernel`` (one program per token and head): the per-head RMSNorm (Qwen3's q/k norm,
optional), the rotary embedding (over the first ``ROT`` dimensions of each head: GLM-4.5's and
Qwen3-Next's partial rotary; the rest pass), and for each K/V head the write of K and V into the paged pool;
the rotated queries go to a scratch ``[T, h, d]``.

``_attention_part_kernel`` (split-K "flash decoding": one program per sequence, query head and
chunk of 256+ key positions): online softmax in fp32 over its chunk of the keys
``kv_index[b, start:kv_len[b]]`` (start = kv_len - window with a sliding window, else 0), scores
as fp32 products summed over the head dim (no tensor-core dot: one query row per program, and
decode attention is bound by reading K/V); ``_attention_merge_kernel`` combines the chunks'
(max, sum, weighted values). A first version ran one program per KV head with ``tl.dot`` over
its query heads: 78 us a layer on the H200 at 60 keys (4 programs on the whole GPU).

Same contract as ``kernels/cpu/attention.py::decode_attention`` (the CPU's compiled call), and
the rounding points of the torch path in ``layers/attention.py`` up to the attention itself:
the normalised row rounded to the data type before the weight multiplies it, the rotary's two
products and their sum each rounded; scores are kept in fp32 (the torch path rounds them to the
data type before its fp32 softmax, and its probabilities before the second matmul), so bf16
results differ within bf16 noise. Tolerances (tests/engine/test_triton_decode.py, against the
reference computed in fp32): fp32 ``1e-5`` of the largest output; bf16 ``2^-7`` of it (``2^-6``
under Triton's interpreter, which truncates to bf16 instead of rounding).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_N = 64          # keys per step of a program's loop
MIN_CHUNK = 256       # keys per program (more for long contexts, so that at most MAX_SPLITS)
MAX_SPLITS = 64


@triton.jit
def _rope_write_kernel(qkv, qw, kw, cos, sin, slots, q_out, k_cache, v_cache, eps, row_stride,
                       H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr,
                       ROT: tl.constexpr, BD: tl.constexpr, V_IS_K: tl.constexpr):
    t = tl.program_id(0)
    hh = tl.program_id(1)                      # 0..H-1 query heads, then the KVH key heads (and V)
    dt = qkv.dtype.element_ty
    d = tl.arange(0, BD)                       # BD: D, or the power of two above it (masked)
    dm = d < D
    rot = d < ROT                              # the first ROT dimensions rotate, the rest pass
    rolled = tl.where(rot, (d + ROT // 2) % ROT, d)    # rotate-half as a roll; the sin table is signed
    base = qkv + t * row_stride + hh * D
    x = tl.load(base + d, mask=dm, other=0.0).to(tl.float32)
    xr = tl.load(base + rolled, mask=dm, other=0.0).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        if hh < H:
            w = tl.load(qw + d, mask=dm, other=0.0).to(tl.float32)
            wr = tl.load(qw + rolled, mask=dm, other=0.0).to(tl.float32)
        else:
            w = tl.load(kw + d, mask=dm, other=0.0).to(tl.float32)
            wr = tl.load(kw + rolled, mask=dm, other=0.0).to(tl.float32)
        x = ((x * rstd).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        xr = ((xr * rstd).to(dt).to(tl.float32) * wr).to(dt).to(tl.float32)
    c = tl.load(cos + t * ROT + d, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin + t * ROT + d, mask=rot, other=0.0).to(tl.float32)
    y = ((x * c).to(dt).to(tl.float32) + (xr * s).to(dt).to(tl.float32)).to(dt)
    if hh < H:
        tl.store(q_out + (t * H + hh) * D + d, y, mask=dm)
    else:
        slot = tl.load(slots + t)
        kh = hh - H
        if not V_IS_K:                         # a pool whose V is its K (cache/kv.py) takes the key only
            v = tl.load(qkv + t * row_stride + (H + KVH + kh) * D + d, mask=dm)
            tl.store(v_cache + (slot * KVH + kh) * D + d, v, mask=dm)
        tl.store(k_cache + (slot * KVH + kh) * D + d, y, mask=dm)


@triton.jit
def _attention_part_kernel(q_ptr, k_cache, v_cache, kv_index, kv_len, part_m, part_l, part_acc, scale, window,
                           idx_stride, chunk, span, H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr,
                           D: tl.constexpr, BN: tl.constexpr, WINDOW: tl.constexpr, BD: tl.constexpr,
                           SPAN: tl.constexpr):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    sp = tl.program_id(2)
    ns = tl.num_programs(2)
    kh = hq // G
    d = tl.arange(0, BD)
    dm = d < D
    q = tl.load(q_ptr + (b * H + hq) * D + d, mask=dm, other=0.0).to(tl.float32)
    n = tl.load(kv_len + b).to(tl.int32)
    lo = n * 0
    if WINDOW:
        lo = tl.maximum(n - window, 0)
    if SPAN:                                   # Llama 4's chunks: the keys of the token's own
        lo = tl.maximum(lo, (n - 1) // span * span)
    begin = tl.maximum(lo, sp * chunk)
    end = tl.minimum(n, sp * chunk + chunk)
    m_i = tl.max(tl.full([BN], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BN], tl.float32), 0)
    acc = tl.zeros([BD], tl.float32)
    for s0 in range(begin, end, BN):
        offs = s0 + tl.arange(0, BN)
        km = offs < end
        slot = tl.load(kv_index + b * idx_stride + offs, mask=km, other=0)
        at = (slot[:, None] * KVH + kh) * D + d[None, :]
        k = tl.load(k_cache + at, mask=km[:, None] & dm[None, :], other=0.0).to(tl.float32)
        sc = tl.where(km, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 0))
        p = tl.exp(sc - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache + at, mask=km[:, None] & dm[None, :], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    row = (b * H + hq) * ns + sp
    tl.store(part_m + row, m_i)
    tl.store(part_l + row, l_i)
    tl.store(part_acc + row * D + d, acc, mask=dm)


@triton.jit
def _attention_merge_kernel(part_m, part_l, part_acc, out_ptr, sinks, NS: tl.constexpr, BS: tl.constexpr,
                            D: tl.constexpr, BD: tl.constexpr, H: tl.constexpr, SINKS: tl.constexpr):
    r = tl.program_id(0)                       # (sequence, query head)
    sp = tl.arange(0, BS)
    sm = sp < NS
    d = tl.arange(0, BD)
    dm = d < D
    m = tl.load(part_m + r * NS + sp, mask=sm, other=float("-inf"))
    top = tl.max(m, 0)
    if SINKS:                                  # the head's sink: one more logit in the denominator
        sink = tl.load(sinks + r % H).to(tl.float32)
        top = tl.maximum(top, sink)
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
    l_sum = tl.sum(tl.load(part_l + r * NS + sp, mask=sm, other=0.0) * w, 0)
    if SINKS:
        l_sum += tl.exp(sink - top)
    acc = tl.load(part_acc + (r * NS + sp)[:, None] * D + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / l_sum
    tl.store(out_ptr + r * D + d, out.to(out_ptr.dtype.element_ty), mask=dm)


def supported(x: torch.Tensor, k_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether ``decode_attention`` takes this layer: data and pool of one float dtype on one
    device, a contiguous ``[slots, kvh, d]`` pool, and an even head dim of 16 to 1024 (one that is
    not a power of two, a latent attention's 576, runs in the power of two above it, masked)."""
    return (x.dtype in DTYPES and k_cache.dtype == x.dtype and k_cache.device == x.device
            and k_cache.is_contiguous() and 16 <= head_dim <= 1024 and head_dim % 2 == 0)


def decode_attention(qkv: torch.Tensor, h: int, kvh: int, d: int, q_norm: torch.Tensor | None,
                     k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     kv_index: torch.Tensor, kv_len: torch.Tensor, window: int | None, scale: float,
                     write_first: bool = True, sinks: torch.Tensor | None = None,
                     chunk: int | None = None) -> torch.Tensor:
    """qkv [T, (h + 2 kvh) d] of T decode tokens (token t is sequence t) -> attention output
    [T, h d]; writes the new K/V at ``slot_mapping`` first (every row's, in its own launch, so
    ``write_first`` always holds: rows of one sequence see each other's keys). ``q_norm`` / ``k_norm``: per-head
    RMSNorm weights [d] or None; cos / sin [T, 1, r] from ``Rotary.cos_sin`` (the first r <= d
    dimensions of each head rotate); kv_index [T, L]
    the pool slots of each sequence's keys, kv_len [T] how many it has after this token;
    ``sinks [h]``: a logit per query head in each softmax's denominator, or None; ``chunk``: a
    token sees only the keys of its own chunk of that many positions (Llama 4), or None."""
    t = qkv.shape[0]
    if qkv.stride(-1) != 1 or t == 0:
        raise ValueError(f"qkv must be a non-empty row-major [T, (h + 2 kvh) d], got {tuple(qkv.shape)}")
    q = torch.empty((t, h, d), dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    w = q_norm if norm else qkv
    _rope_write_kernel[(t, h + kvh)](qkv, w, k_norm if norm else qkv, cos.contiguous(), sin.contiguous(),
                                     slot_mapping, q, k_cache, v_cache, float(eps), qkv.stride(0),
                                     H=h, KVH=kvh, D=d, NORM=norm, ROT=cos.shape[-1], BD=next_pow2(d),
                                     V_IS_K=v_cache.data_ptr() == k_cache.data_ptr())
    out = torch.empty((t, h * d), dtype=qkv.dtype, device=qkv.device)
    width = kv_index.shape[1]                  # keys any sequence may have (a graph's bucket)
    chunk_keys = max(MIN_CHUNK, next_pow2(-(-width // MAX_SPLITS)))
    splits = -(-width // chunk_keys)
    part_m = torch.empty((t * h * splits,), dtype=torch.float32, device=qkv.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((t * h * splits, d), dtype=torch.float32, device=qkv.device)
    _attention_part_kernel[(t, h, splits)](q, k_cache, v_cache, kv_index, kv_len, part_m, part_l, part_acc,
                                           float(scale), int(window or 0), kv_index.stride(0), chunk_keys,
                                           int(chunk or 1), H=h, KVH=kvh, G=h // kvh, D=d, BN=BLOCK_N,
                                           WINDOW=window is not None, BD=next_pow2(d), SPAN=chunk is not None)
    sink = part_m if sinks is None else sinks.float().contiguous()
    _attention_merge_kernel[(t * h,)](part_m, part_l, part_acc, out, sink, NS=splits, BS=next_pow2(splits), D=d,
                                      BD=next_pow2(d), H=h, SINKS=sinks is not None)
    return out
