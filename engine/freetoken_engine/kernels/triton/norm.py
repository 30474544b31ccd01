"""RMSNorm on the GPU in one launch (torch's path is four: a cast up, the norm, a cast back, the
weight's multiply; ``bench/engine_profile.py`` counted 193 such norm launches in a 48-layer decode
step). One program per row; the same rounding points as ``reference.rms_norm_forward``: fp32
statistics, and with 16-bit data the normalised row rounded to the data type before the weight
multiplies it. Tolerance (tests/engine/test_triton_decode.py): fp32 1e-6 relative; 16-bit
one rounding (2^-7 relative; 2^-6 under Triton's interpreter, which truncates instead of rounding).

``add_rms_norm``: the decoder's residual add and the next norm in one launch (two in torch's
path, and the sum is written once and read back): ``s = residual + x`` rounded to the data type,
then the norm of ``s``, both returned; bitwise the same as the add followed by ``rms_norm``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, out_ptr, eps, n, BLOCK: tl.constexpr, ROUND: tl.constexpr,
                     ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=m, other=0.0).to(tl.float32)
    if ADD:         # s = residual + x, rounded to the data type, then normalised
        s = (tl.load(res_ptr + row * n + cols, mask=m, other=0.0).to(tl.float32) + x).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n + cols, s, mask=m)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    y = x * rstd
    if ROUND:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (y * w).to(out_ptr.dtype.element_ty), mask=m)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype in (torch.float32, torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.is_contiguous() and x.shape[-1] == weight.numel() and x.shape[-1] <= 16384)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] (contiguous), weight [H] of x's dtype -> [..., H]."""
    out = torch.empty_like(x)
    _launch(x, x, x, weight, out, eps, add=False)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H] (contiguous, one dtype), weight [H] -> (residual + x, its RMSNorm)."""
    s, out = torch.empty_like(x), torch.empty_like(x)
    _launch(x, residual, s, weight, out, eps, add=True)
    return s, out


def _launch(x, residual, s, weight, out, eps: float, add: bool) -> None:
    n = x.shape[-1]
    if x.numel():
        _rms_norm_kernel[(x.numel() // n,)](x, residual, s, weight, out, float(eps), n, BLOCK=next_pow2(n),
                                           ROUND=x.dtype != torch.float32, ADD=add)
