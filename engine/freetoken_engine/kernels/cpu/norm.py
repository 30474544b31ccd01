"""Compiled RMSNorm for CPU rows: ``rms_norm(x, w, eps)`` in one call instead of a chain of ops.

Same result as ``reference.rms_norm_forward`` (what layers/norm.py computes): fp32 statistics,
``x * rsqrt(mean(x^2) + eps) * w``; with bf16 data the normalised row is rounded to bf16
before the weight multiplies it, exactly where the reference rounds. Used for bf16 data, where
the reference is four torch ops (float, rms_norm, to, mul); fp32 keeps the single fused torch op.

Tolerance (tests/engine/test_cpu_decode.py): ``|y - ref| <= 2^-7 |ref| + 1e-6`` (the statistic is
summed in another order, which may move one bf16 rounding by one ulp).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import cpu_experts


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] bf16 on the CPU, weight [H] bf16 -> [..., H]; other cases use torch."""
    lib = cpu_experts._load()
    if (lib is None or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu"
            or not x.is_contiguous() or (torch.is_grad_enabled() and x.requires_grad)):
        return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
    out = torch.empty_like(x)
    h = x.shape[-1]
    lib.ft_rmsnorm(x.data_ptr(), x.numel() // h, h, weight.data_ptr(), eps, 1, out.data_ptr())
    return out
