"""Dense projections: ``linear`` (a decode step's GEMV as the compiled CPU kernel on the CPU and a
Triton kernel on a GPU, else ``F.linear``) and ``use_compiled_linears``, the post-construction
pass that routes a model's ``nn.Linear`` modules through it (the model files keep plain
``nn.Linear``; see kernels/cpu/linear.py and kernels/triton/gemv.py)."""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import gpu_decode_kernels
from ..kernels.cpu.linear import linear as _host_linear

__all__ = ["Linear", "linear", "use_compiled_linears"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [T, K], weight [N, K] -> [T, N]. 1-16 tokens on a GPU go
    through kernels/triton/gemv.py unless FREETOKEN_GPU_DECODE_KERNELS leaves "gemv" out; CPU
    tensors through kernels/cpu/linear.py (which falls back to ``F.linear`` itself)."""
    if x.device.type == "cuda":
        gpu = gpu_decode_kernels("gemv")
        if gpu is not None and gpu.supported(x, weight, bias):
            return gpu.linear(x, weight, bias)
    return _host_linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is ``linear`` (same parameters, same result)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_compiled_linears(model: nn.Module) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` into ``Linear`` in place; returns the count."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = Linear
            n += 1
    return n
