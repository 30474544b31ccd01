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

    def begin(self, layer: int, act: GatedAct, b13: torch.Tensor | None) -> bool:
        """Whether ``act`` / ``b13`` make the layer's experts of another kind (then set for the call)."""
        plain = act == SILU and b13 is None
        self._call = None if plain else (act, b13, layer)
        return not plain

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
