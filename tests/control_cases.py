"""Small expert banks, warmed device controls and routings shared by the device control step's
tests (tests/engine/test_device_control.py, test_guessed_fills.py): 3 layers of 12 experts,
H 16, I 8, top-4, bf16."""
from __future__ import annotations

import torch

from freetoken_engine.cache.bank import ExpertBank
from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.cache.experts import ExpertCache

LAYERS, EXPERTS, H, I, K = 3, 12, 16, 8, 4


def bank(seed: int = 0, experts: int = EXPERTS) -> ExpertBank:
    bank = ExpertBank(LAYERS, experts, H, I, torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    bank.w13.copy_(torch.randn(bank.w13.shape, generator=g))
    bank.w2.copy_(torch.randn(bank.w2.shape, generator=g))
    return bank


def warm_controls(bank: ExpertBank, seed: int, count: int) -> list[DeviceControl]:
    """``count`` device controls over 7-slot pools (q* 0.5, admission window 1), each after the
    same three warm-up steps of every layer (``routing`` of 2 tokens over 10 hot experts)."""
    g = torch.Generator().manual_seed(seed)
    warm = [(layer, routing(g, 2, 10)) for _ in range(3) for layer in range(LAYERS)]
    ctls = []
    for _ in range(count):
        ctl = DeviceControl.from_cache(ExpertCache(bank, 7, "cpu", fill_fraction=0.5, admit_window=1))
        for layer, ids in warm:
            ctl.step(layer, ids)
        ctls.append(ctl)
    return ctls


def routing(g: torch.Generator, tokens: int, hot: int) -> torch.Tensor:
    """Top-k ids drawn from the first ``hot`` experts: repeats across steps give hits."""
    return torch.stack([torch.randperm(hot, generator=g)[:K] for _ in range(tokens)])
