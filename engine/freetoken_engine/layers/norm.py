"""RMSNorm computed in float32 and cast back, as the reference implementations do: one compiled
call on the CPU (kernels/cpu/norm.py), one Triton launch on a GPU (kernels/triton/norm.py), else
torch's ops."""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import gpu_decode_kernels
from ..kernels.cpu.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gpu = gpu_decode_kernels("norm") if x.device.type == "cuda" else None
        if gpu is not None and gpu.supported(x, self.weight) and not (torch.is_grad_enabled() and x.requires_grad):
            return gpu.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)      # one compiled call on the CPU, else torch

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's residual add and this norm: ``(residual + x, norm(residual + x))``; one
        launch on a GPU, the same rounding either way."""
        gpu = gpu_decode_kernels("combine") if x.device.type == "cuda" else None
        if (gpu is not None and gpu.norm_supported(x, self.weight) and residual.is_contiguous()
                and residual.shape == x.shape and residual.dtype == x.dtype
                and not (torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad))):
            return gpu.add_rms_norm(x, residual, self.weight, self.eps)
        s = residual + x
        return s, self(s)
