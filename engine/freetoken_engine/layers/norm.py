"""RMSNorm computed in float32 and cast back, as the reference implementations do: one compiled
call on the CPU (kernels/cpu/norm.py), one Triton launch on a GPU (kernels/triton/norm.py), else
torch's ops."""
from __future__ import annotations

import functools

import torch
from torch import nn

from .. import env
from ..kernels.cpu.norm import rms_norm


@functools.cache
def _triton_norm():
    if not env.gpu_decode_kernels():
        return None
    try:
        from ..kernels.triton import norm
    except ImportError:
        return None
    return norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda" and _triton_norm() is not None and _triton_norm().supported(x, self.weight) \
                and not (torch.is_grad_enabled() and x.requires_grad):
            return _triton_norm().rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)      # one compiled call on the CPU, else torch
