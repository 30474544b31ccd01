"""Compiled RMSNorm for CPU rows: ``rms_norm(x, w, eps)`` in one call instead of a chain of ops.

Same result as ``reference.rms_norm_forward`` (what layers/norm.py computes): fp32 statistics,
``x * rsqrt(mean(x^2) + eps) * w``; with bf16 data the normalised row is rounded to bf16
before the weight multiplies it, exactly where the reference rounds. On the CPU torch's fused
``rms_norm`` still runs about a dozen ops (pow, mean, add, rsqrt, mul, casts; ~15 us a call,
9 calls a token on a 4-layer model); this is one call of ~2 us.

Tolerance (tests/engine/test_cpu_decode.py): fp32 ``|y - ref| <= 1e-6 |ref| + 1e-6`` (the
statistic is summed in another order); bf16 ``|y - ref| <= 2^-7 |ref| + 1e-6`` (which may move
one bf16 rounding by one ulp).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import cpu_experts

_DT = {torch.float32: 0, torch.bfloat16: 1}
_MAX_ROWS = 8   # decode-sized calls (hidden rows of a few tokens); prefill keeps torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H]: compiled for decode-sized fp32/bf16 CPU tensors,
    else torch (prefill keeps torch's arithmetic, the one transformers uses)."""
    lib = cpu_experts._load()
    if (lib is None or x.numel() > _MAX_ROWS * x.shape[-1] or x.dtype not in _DT or weight.dtype != x.dtype or x.device.type != "cpu"
            or not x.is_contiguous() or (torch.is_grad_enabled() and x.requires_grad)):
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
    out = torch.empty_like(x)
    h = x.shape[-1]
    lib.ft_rmsnorm(x.data_ptr(), x.numel() // h, h, weight.data_ptr(), eps, _DT[x.dtype], out.data_ptr())
    return out
