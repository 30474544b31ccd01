"""How the calibration times B_pcie on a GPU (calibrate._fills): decode's fill gather, or DMA
copies with a warning when the gather cannot start. The GPU side: tests/gpu/test_calibrate_gpu.py."""
from __future__ import annotations

import logging

import torch

from freetoken_engine import calibrate


def test_without_the_gather_b_pcie_falls_back_to_dma_copies_and_says_so(monkeypatch, caplog):
    made = []

    class Dma:
        path = "dma"

        def __init__(self, device):
            made.append(device)

    def no_triton(device):
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(calibrate, "_GatherFills", no_triton)
    monkeypatch.setattr(calibrate, "_PcieCopies", Dma)
    with caplog.at_level(logging.WARNING, logger="freetoken_engine.calibrate"):
        fills = calibrate._fills(torch.device("cuda"))
    assert fills.path == "dma" and made == [torch.device("cuda")]
    assert "fill gather did not run (No module named 'triton'); timing B_pcie with DMA copies" in caplog.text


def test_the_gather_is_the_first_choice(monkeypatch):
    class Gather:
        path = "gather"

        def __init__(self, device):
            self.device = device

    monkeypatch.setattr(calibrate, "_GatherFills", Gather)
    assert calibrate._fills(torch.device("cuda")).path == "gather"
