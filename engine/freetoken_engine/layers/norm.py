"""RMSNorm computed in float32 and cast back, as the reference implementations do: one compiled
call on the CPU (kernels/cpu/norm.py), one Triton launch on a GPU (kernels/triton/norm.py), else
torch's ops."""
from __future__ import annotations

import torch
import torch.nn.functional as F
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


class LayerNorm(nn.Module):
    """``nn.LayerNorm`` with a weight and a bias (Phi-3.5-MoE's norms) or a weight only (Cohere's),
    under ``RMSNorm``'s interface; torch's own kernel on every device (its statistics in float32)."""

    def __init__(self, dim: int, eps: float, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = residual + x
        return s, self(s)


class L2Norm(nn.Module):
    """RMSNorm without a weight (Llama 4's q/k norm): float32 statistics, cast back."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = x.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def hidden_norm(dim: int, eps: float, layer_norm: bool, bias: bool = True) -> RMSNorm | LayerNorm:
    """The norm a model applies to its hidden state (``ModelConfig.layer_norm``, ``layer_norm_bias``)."""
    return LayerNorm(dim, eps, bias) if layer_norm else RMSNorm(dim, eps)
