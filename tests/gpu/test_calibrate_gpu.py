"""The calibration on a GPU times B_pcie through decode's fill gather (calibrate._GatherFills), the
path a decode step's fills take, and the gather copies the rows exactly."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from freetoken_engine import calibrate  # noqa: E402


def test_b_pcie_is_the_fill_gathers_rate_beside_the_cpu():
    out = calibrate.measure("cuda", seconds=0.3)
    assert out["pcie_path"] == "gather"
    conc = out["concurrent"]
    assert 5.0 < out["pcie_gbps"] < 100.0 and 1.0 < conc["pcie_gbps"] < 100.0
    assert out["fill_fraction"] == pytest.approx(conc["pcie_gbps"] / (conc["pcie_gbps"] + conc["cpu_expert_gbps"]))
    dma = calibrate._PcieCopies(torch.device("cuda")).gbps(0.3)
    print(f"gather {out['pcie_gbps']:.1f} GB/s alone, {conc['pcie_gbps']:.1f} beside the CPU; DMA {dma:.1f}")
    assert out["pcie_gbps"] < 1.3 * dma            # a gather that read a cached copy would be faster


def test_the_calibrations_fills_copy_the_rows_they_time():
    fills = calibrate._GatherFills(torch.device("cuda"))
    for t in (fills.src13, fills.src2):
        t.view(torch.int16).random_()
    for expert in (3, 11):
        fills.turn = expert - 1                    # the next fill takes this expert
        fills._copy()
        torch.cuda.synchronize()
        assert torch.equal(fills.dst13[0].cpu().view(torch.int16), fills.src13[0, expert].view(torch.int16))
        assert torch.equal(fills.dst2[0].cpu().view(torch.int16), fills.src2[0, expert].view(torch.int16))
