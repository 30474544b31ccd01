"""Compiled decode attention: one new token per sequence over the paged KV pool, in one call.

``decode_attention(qkv, ...)`` takes the fused q/k/v projection of the new tokens and does what
layers/attention.py does for them with a chain of about twenty torch ops: per-head RMSNorm of q
and k (when the model has it), the rotary embedding, the K/V write into the token's slot, and
``softmax(q k^T * scale) v`` over the sequence's keys for every query head of each KV head
(grouped-query attention), with a sliding window when the layer has one. Scores, softmax and
the weighted sum run in fp32; norm and rotary round to the data type where the reference
(``reference.decode_attention_forward``) rounds, so the written K cache is the reference's.

Tolerance (tests/engine/test_cpu_decode.py): fp32 ``|y - ref| <= 1e-5 max|ref| + 1e-6``;
bf16 ``|y - ref32| <= 2^-7 max|ref32|`` against the fp32 reference of the same inputs.
"""
from __future__ import annotations

import ctypes

import torch

from .. import cpu_experts

_i64, _vp = ctypes.c_int64, ctypes.c_void_p


class _FtAttn(ctypes.Structure):   # FtAttn in experts.h, field for field
    _fields_ = [("B", _i64), ("h", _i64), ("kvh", _i64), ("d", _i64), ("qkv", _vp), ("qn_w", _vp),
                ("kn_w", _vp), ("eps", ctypes.c_float), ("cos", _vp), ("sin", _vp), ("k_cache", _vp),
                ("v_cache", _vp), ("slot", _vp), ("kv_index", _vp), ("lmax", _i64), ("kv_len", _vp),
                ("window", _i64), ("scale", ctypes.c_float), ("bf16", ctypes.c_int), ("phase", ctypes.c_int),
                ("out", _vp), ("scratch", _vp), ("rot", _i64), ("hsplit", _i64), ("sinks", _vp),
                ("chunk", _i64)]


def supported(x: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``decode_attention`` can run these tensors (CPU, fp32/bf16, compiled kernel)."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and k_cache.dtype == x.dtype
            and not (torch.is_grad_enabled() and x.requires_grad) and cpu_experts._load() is not None)


def decode_attention(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                     q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot: torch.Tensor, kv_index: torch.Tensor, kv_len: torch.Tensor,
                     window: int | None, scale: float, write_first: bool = False,
                     sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """qkv [B, (h + 2 kvh) d]; cos / signed sin [B, 1, r] (the first r <= d dimensions of each head
    rotate: r < d a partial rotary); caches [S, kvh, d] (K/V of the new
    tokens are written at ``slot [B]``); kv_index [B, Lmax] slots by position; kv_len [B] keys per
    sequence, the new token included -> attention output [B, h d]. ``write_first``: every row's
    K/V is written before any row attends (two calls: rows of one sequence at consecutive
    positions, a draft's verification; otherwise each row, on whichever thread, writes then
    attends). ``sinks [h]``: a logit per query head in each softmax's denominator (attention
    sinks), or None; ``chunk``: each token sees only the keys of its own chunk of that many
    positions (Llama 4), or None. Call only when ``supported``."""
    b = qkv.shape[0]
    out = torch.empty((b, heads * head_dim), dtype=qkv.dtype)
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    kv_index = kv_index.contiguous()
    sinks = None if sinks is None else sinks.float().contiguous()
    lib = cpu_experts._load()
    for phase in ((1, 2) if write_first else (0,)):
        p = _FtAttn(b, heads, kv_heads, head_dim, qkv.data_ptr(),
                    None if q_norm is None else q_norm.data_ptr(), None if k_norm is None else k_norm.data_ptr(),
                    eps, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot.data_ptr(),
                    kv_index.data_ptr(), kv_index.shape[1], kv_len.data_ptr(), window or 0, scale,
                    int(qkv.dtype == torch.bfloat16), phase, out.data_ptr(), None, cos.shape[-1], 0,
                    None if sinks is None else sinks.data_ptr(), chunk or 0)
        if lib.ft_attn(ctypes.addressof(p)) != 0:
            raise ValueError(lib.ft_last_error().decode())
    return out
