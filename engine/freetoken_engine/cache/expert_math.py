"""The expert math of a model whose experts are of another kind than silu(gate) * up (gpt-oss:
``MoeConfig.activation`` / ``expert_bias``): what every expert call of a MoE layer takes beside its
weights, as ``kernels/reference.expert_pairs_forward``'s keyword arguments, and what the CPU
branch computes its experts with."""
from __future__ import annotations

import torch

from ..kernels.reference import SILU, GatedAct


class ExpertMath:
    """The model's experts (``set_model``, from the runner: plain until then); ``begin`` / ``end``
    frame one MoE layer's call, and ``kwargs`` gives each expert call of it its arguments: none for
    plain experts; else the activation, the layer's gate/up biases (on the host the float32 rows
    of every layer, copied once: the compiled kernels') and, where the call's indices are cache
    slots, each pair's expert (``pair_bias``)."""

    def __init__(self):
        self.act: GatedAct = SILU
        self.layer_b13: list[torch.Tensor | None] = []
        self._layer: int | None = None         # the call in progress (experts of another kind only)
        self._host: torch.Tensor | None = None  # [L, E, 2I] float32 host rows of every layer's biases

    def set_model(self, act: GatedAct, layer_b13: list[torch.Tensor | None]) -> None:
        """The model's experts: their activation and each MoE layer's gate/up biases [E, 2I] (the
        layer's parameters; None: none)."""
        self.act, self.layer_b13, self._host = act, list(layer_b13), None

    @property
    def plain(self) -> bool:
        """The model's experts are silu(gate) * up without biases."""
        return self.act == SILU and all(b is None for b in self.layer_b13)

    def host_b13(self) -> torch.Tensor | None:
        """``[L, E, 2I]`` float32 host copy of every layer's gate/up biases (None: no biases)."""
        if self._host is None and self.layer_b13 and self.layer_b13[0] is not None:
            self._host = torch.stack([b.detach().float().cpu() for b in self.layer_b13])
        return self._host

    def gate_branch(self, branch, first: int, layers: int) -> None:
        """Give the CPU branch (``kernels/cpu_branch.CpuBranch``) of MoE layers [first, first +
        layers) the model's experts, when they are not plain."""
        if not self.plain:
            host = self.host_b13()
            branch.set_gate(self.act, None if host is None else host[first:first + layers])

    def begin(self, layer: int) -> None:
        self._layer = None if self.plain else layer

    def end(self) -> None:
        self._layer = None

    def kwargs(self, x: torch.Tensor, pair_bias: torch.Tensor | None = None) -> dict:
        if self._layer is None:
            return {}
        b13 = self.layer_b13[self._layer]
        if b13 is not None and x.device.type == "cpu" and not (b13.is_cpu and b13.dtype == torch.float32):
            b13 = self.host_b13()[self._layer]          # (float32 host parameters serve as they are)
        return dict(act=self.act, b13=b13) if pair_bias is None else dict(act=self.act, b13=b13, pair_bias=pair_bias)
