"""Compiled dense projection for decode: ``linear(x, w, b)`` at host-memory bandwidth.

Same result as ``reference.linear_forward`` (``F.linear``): ``out[t] = w @ x[t] (+ b)`` in
``x.dtype``, fp32 accumulation, one rounding to bf16 at the end when ``x`` is bf16. A decode
step multiplies one token (a few, batched) by every weight matrix, so it is a matrix-vector
product bounded by reading the weights once: the kernel streams the rows once, one at a time
in address order (simd.h ``dotr``), against up to 8 token vectors held in L1, converting bf16
in registers (AVX-512-BF16 ``vdpbf16ps`` when ``x`` is bf16 too). On the 2-CPU EPYC (one thread,
single-thread read ~40 GB/s) torch's single-token GEMV reads bf16 weights at 14-17 GB/s and
fp32 at 16-21 GB/s; this kernel reads both at 30-38 GB/s (shapes of SmolLM2 and of the bench's
Qwen3-MoE, matrices larger than the LLC).

Used only where it is the same computation: CPU tensors, 2-D ``x`` of at most ``MAX_TOKENS``
rows, ``x`` and ``w`` both float32 or both bfloat16, or float32 ``x`` with bfloat16 ``w`` (and
bias) as a CPU engine computing in float32 keeps a bfloat16 checkpoint's projections
(``models/build``), ``w`` with unit stride in its last dimension, no autograd. Everything else
(prefill, GPU, other dtypes) goes to ``F.linear``, the weights in ``x``'s dtype.

Tolerance against the reference (tested in tests/engine/test_cpu_linear.py): float32:
``|y - ref| <= 1e-5 * (|x| . |w|) + 1e-6`` per element (summation order only); bfloat16: the
kernel's result is the fp32 sum rounded once, so ``|y - ref32| <= 2^-8 |ref32| + 1e-5 (|x| . |w|)``
against the fp32 reference of the same bf16 inputs.

Threads and the instruction set follow the expert kernel's configuration (``cpu_experts``);
without a compiler every call is ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import cpu_experts

MAX_TOKENS = 8          # up to this many rows of x the compiled kernel is used (decode)
_DT = {torch.float32: 0, torch.bfloat16: 1}
_CPU = torch.device("cpu")
_lib = None
_checked = False


def _library():
    global _lib, _checked
    if not _checked:
        _lib = cpu_experts._load()
        _checked = True
    return _lib


def available() -> bool:
    """True when calls can use the compiled kernel (built on first use)."""
    return _library() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; compiled for small CPU batches (see the module docstring).

    x [T, K]; weight [N, K]; bias [N] or None -> [T, N] in x.dtype.
    """
    lib = _lib if _checked else _library()
    dt, wt = x.dtype, weight.dtype
    if (lib is None or x.dim() != 2 or x.shape[0] > MAX_TOKENS or x.device != _CPU
            or not (wt == dt or (dt == torch.float32 and wt == torch.bfloat16)) or dt not in _DT
            or weight.device != _CPU or weight.stride(-1) != 1 or x.shape[1] != weight.shape[1]
            or (bias is not None and bias.dtype != wt)
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        if wt != dt:                    # a bfloat16 projection under float32: the same values, widened
            weight, bias = weight.to(dt), None if bias is None else bias.to(dt)
        return F.linear(x, weight, bias)
    if not x.is_contiguous():
        x = x.contiguous()
    t, n = x.shape[0], weight.shape[0]
    out = torch.empty((t, n), dtype=dt)
    lib.ft_linear(x.data_ptr(), _DT[dt], t, x.shape[1], weight.data_ptr(), _DT[wt], n, weight.stride(0),
                  None if bias is None else bias.contiguous().data_ptr(), out.data_ptr())
    return out
