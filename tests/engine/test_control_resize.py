"""A resizable pool: the engine binds its device control with ``resizable=True`` so that the
control kernel is sized once for all experts. Resizing under memory pressure must then give the
same steps as the expert cache's torch step (TRITON_INTERPRET=1 on the CPU; the GPU test in
tests/gpu/test_engine_gpu.py checks that no kernel is compiled again)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")
if os.environ["TRITON_INTERPRET"] != "1" and not torch.cuda.is_available():
    pytest.skip("Triton needs TRITON_INTERPRET=1 without a GPU", allow_module_level=True)

from freetoken_engine.cache.bank import ExpertBank
from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.cache.experts import ExpertCache
from freetoken_engine.kernels.triton.control import ControlOutputs, control_step, fill_table

LAYERS, EXPERTS, H, I, K = 3, 12, 16, 8, 4


def test_resizable_control_matches_cache_step_across_shrinks_and_regrowth():
    bank = ExpertBank(LAYERS, EXPERTS, H, I, torch.float32)
    g = torch.Generator().manual_seed(3)
    bank.w13.copy_(torch.randn(bank.w13.shape, generator=g))
    bank.w2.copy_(torch.randn(bank.w2.shape, generator=g))
    ref = ExpertCache(bank, 30, "cpu", fill_fraction=0.6)
    dev = ExpertCache(bank, 30, "cpu", fill_fraction=0.6)
    ctl = DeviceControl.from_cache(dev, resizable=True)
    assert ctl.max_slots == LAYERS * EXPERTS
    for capacity in (30, 7, 4, 17, 36):                 # a game starts, takes more, quits
        ctl.write_back(dev)
        ref.resize(capacity)
        dev.resize(capacity)
        ctl.refresh(dev)
        for _ in range(3):
            for layer in range(LAYERS):
                ids = torch.stack([torch.randperm(10, generator=g)[:K] for _ in range(2)])
                assert torch.equal(ctl.step(layer, ids).pair_slot, ref.step(layer, ids.reshape(-1)))
        ctl.write_back(dev)
        dev.check_integrity(deep=True)
        assert dev.stats == ref.stats
        assert torch.equal(dev.slot_of, ref.slot_of) and torch.equal(dev.last_used, ref.last_used)


def test_block_slots_below_the_pool_is_refused():
    slot_of = torch.full((1, 4), -1, dtype=torch.int64)
    owner, last = torch.full((8,), -1, dtype=torch.int64), torch.full((8,), -1, dtype=torch.int64)
    out = ControlOutputs.allocate(2, 4, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="block_slots 4 < the pool's 8 slots"):
        control_step(0, torch.tensor([[0, 1]]), slot_of, owner, last, torch.zeros(1, dtype=torch.int64),
                     fill_table(1.0, 4, torch.device("cpu")), torch.zeros(4, dtype=torch.int64), out,
                     block_slots=4)
