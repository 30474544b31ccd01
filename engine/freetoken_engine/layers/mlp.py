"""Dense SwiGLU MLP (llama/qwen dense layers, the qwen2_moe shared expert)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import linear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fuse(self) -> None:
        """After loading: one [gate; up] matmul instead of two."""
        with torch.no_grad():
            w = torch.cat([self.gate_proj.weight, self.up_proj.weight])
            b = torch.cat([self.gate_proj.bias, self.up_proj.bias]) if self.gate_proj.bias is not None else None
        self.gate_up = (w, b)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of x, plus ``residual`` when given (the decoder's residual add)."""
        if self.gate_up is None:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        else:
            gate, up = linear(x, *self.gate_up).chunk(2, dim=-1)
            out = self.down_proj(F.silu(gate) * up)
        return out if residual is None else residual + out
