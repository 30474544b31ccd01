"""The expert math of the MoE call in progress, for experts of another kind than silu(gate) * up
(gpt-oss: ``MoeConfig.activation`` / ``expert_bias``): what every expert call of the call takes
beside its weights, as ``kernels/reference.expert_pairs_forward``'s keyword arguments."""
from __future__ import annotations

import torch

from ..kernels.reference import SILU, GatedAct


class ExpertMath:
    """Set for one ``OffloadedExperts.forward_beside`` call (``begin`` / ``end``); ``kwargs`` gives
    an expert call its arguments: none for plain experts; else the activation, the layer's gate/up
    biases (for a call on the host a float32 copy, made once a layer: the compiled kernel's rows)
    and, where the call's indices are cache slots, each pair's expert (``pair_bias``)."""

    def __init__(self):
        self._call: tuple[GatedAct, torch.Tensor | None, int] | None = None
        self._host: dict[int, torch.Tensor] = {}
        self.act: GatedAct = SILU
        self.layer_b13: list[torch.Tensor | None] = []

    def set_model(self, act: GatedAct, layer_b13: list[torch.Tensor | None]) -> None:
        """The model's experts, for what runs apart from the MoE calls (the CPU branch): their
        activation and each MoE layer's gate/up biases (None: none)."""
        self.act, self.layer_b13 = act, list(layer_b13)

    @property
    def plain(self) -> bool:
        """The model's experts are silu(gate) * up without biases."""
        return self.act == SILU and all(b is None for b in self.layer_b13)

    def gate_branch(self, branch, first: int, layers: int) -> None:
        """Give the CPU branch (``kernels/cpu_branch.CpuBranch``) of MoE layers [first, first +
        layers) the model's experts, when they are not plain."""
        if self.plain:
            return
        biases = self.layer_b13[first:first + layers]
        branch.set_gate(self.act, None if biases[0] is None else torch.stack([b.detach() for b in biases]))

    def begin(self, layer: int, act: GatedAct, b13: torch.Tensor | None) -> None:
        """The call of ``layer``: ``act`` and ``b13`` its experts' (plain: nothing to pass)."""
        self._call = None if act == SILU and b13 is None else (act, b13, layer)

    def end(self) -> None:
        self._call = None

    def kwargs(self, x: torch.Tensor, pair_bias: torch.Tensor | None = None) -> dict:
        if self._call is None:
            return {}
        act, b13, layer = self._call
        if b13 is not None and x.device.type == "cpu":
            if layer not in self._host:
                self._host[layer] = b13.detach().float().cpu().contiguous()
            b13 = self._host[layer]
        return dict(act=act, b13=b13) if pair_bias is None else dict(act=act, b13=b13, pair_bias=pair_bias)
