"""Whole-layer expert weights for prefill: the interface the MoE layer calls (``WholeLayers``)
and its plain form (``BankStreamer``: bank views on the CPU, a synchronous copy on a GPU). The
double-buffered form with a copy stream, which leaves cached experts out, is ``prefetch.py``'s
``LayerStreamer``.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .bank import ExpertBank


class WholeLayers(Protocol):
    """``layer(l) -> (w13 [E, 2I, H], w2 [E, H, I])``: every expert of layer l, for a prefill call."""

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class BankStreamer:
    """Whole-layer weights for prefill: bank views on the CPU, a synchronous copy on a GPU."""

    def __init__(self, bank: ExpertBank, device: torch.device):
        self.bank, self.device = bank, torch.device(device)
        self._buf: tuple[torch.Tensor, torch.Tensor] | None = None

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = self.bank.w13[layer], self.bank.w2[layer]
        if self.device.type == "cpu":
            return w13, w2
        if self._buf is None:
            self._buf = (torch.empty_like(w13, device=self.device), torch.empty_like(w2, device=self.device))
        self._buf[0].copy_(w13, non_blocking=True)
        self._buf[1].copy_(w2, non_blocking=True)
        return self._buf
