"""Dense projections: ``linear`` (the compiled decode GEMV on the CPU, else ``F.linear``) and
``use_compiled_linears``, the post-construction pass that routes a model's ``nn.Linear``
modules through it (the model files keep plain ``nn.Linear``; see kernels/cpu/linear.py)."""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.cpu.linear import linear

__all__ = ["Linear", "linear", "use_compiled_linears"]


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
