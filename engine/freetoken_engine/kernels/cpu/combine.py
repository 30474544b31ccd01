"""Compiled MoE combine for CPU tensors: an MoE layer's output from its pair rows in one call.

``moe_combine(rows, weights, shared, residual)`` is ``reference.moe_combine_forward`` (what
layers/moe.py computes after the experts): ``sum_j weights[t, j] * rows[t*k + j]``, each product
rounded to the data type and summed in fp32 in the order of j, then ``+ shared[t]`` and
``residual[t] +``, each rounded. Bit for bit the same values (tests/engine/test_cpu_combine.py):
each output element takes its k products in the same order, the kernel only vectorises across
H. torch computes it as a ``[T, k, H]`` product tensor and a reduction over it, which in a
512-token prefill chunk took as long as the chunk's experts (bench/cpu_combine.py); the
compiled call reads the rows once, on the expert kernel's threads for more than a few tokens.
Anything the kernel does not take (a GPU, SplitRows, another dtype, a strided tensor, autograd)
goes to the reference, and so do float32 rows whose width is not a multiple of 64: torch sums the
last columns past its vector blocks (4 vectors: 64 floats with AVX-512, 32 with AVX2) with four
accumulators, in another order.
"""
from __future__ import annotations

import torch

from .. import cpu_experts
from ..reference import SplitRows, moe_combine_forward
from .expert_args import DT as _DT


def _takes(t: torch.Tensor | None, shape: tuple, dtype: torch.dtype) -> bool:
    return t is None or (t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous())


def moe_combine(rows: torch.Tensor | SplitRows, weights: torch.Tensor, shared: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """rows [T*k, H], weights [T, k], shared / residual [T, H] or None -> [T, H] (see the module)."""
    if isinstance(rows, SplitRows) or rows.device.type != "cpu" or rows.dim() != 2 or weights.dim() != 2:
        return moe_combine_forward(rows, weights, shared, residual)
    lib = cpu_experts._lib if cpu_experts._loaded else cpu_experts._load()
    if lib is None:
        return moe_combine_forward(rows, weights, shared, residual)
    (T, k), dt = weights.shape, rows.dtype
    H = rows.shape[1]
    if (dt not in _DT or (dt == torch.float32 and H % 64) or not _takes(rows, (T * k, H), dt)
            or not _takes(weights, (T, k), dt) or not _takes(shared, (T, H), dt) or not _takes(residual, (T, H), dt)
            or (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                for t in (rows, weights, shared, residual)))):
        return moe_combine_forward(rows, weights, shared, residual)
    out = torch.empty((T, H), dtype=dt)
    lib.ft_combine(rows.data_ptr(), weights.data_ptr(), 0 if shared is None else shared.data_ptr(),
                   0 if residual is None else residual.data_ptr(), out.data_ptr(), T, k, H, _DT[dt])
    return out
