"""Fills behind the CPU (``FREETOKEN_FILL_BEHIND``, ``cache/behind.py``) on a real GPU: slices
read from the pinned bank by the device are the bank's bytes, and inside captured decode graphs
with the CPU branch the tokens and logits are those of the same graphs without it."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from freetoken_engine import LLM  # noqa: E402
from freetoken_engine.cache.bank import ExpertBank  # noqa: E402
from freetoken_engine.cache.device_control import DeviceControl  # noqa: E402

from graph_cases import PROMPTS, lockstep  # noqa: E402


def test_slices_from_the_pinned_bank_are_its_bytes_and_land_only_when_complete():
    """48 layers' worth of calls over a pinned bank in Qwen3-30B's expert shape (H 2048, I 768):
    every expert made resident behind the CPU holds its bank rows bit for bit."""
    layers, experts = 4, 16
    bank = ExpertBank(layers, experts, 2048, 768, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    bank.w13.copy_(torch.randn(bank.w13.shape, generator=g))
    bank.w2.copy_(torch.randn(bank.w2.shape, generator=g))
    bank.pin()
    slots = 24
    pool13 = torch.empty((slots, *bank.w13.shape[2:]), dtype=torch.bfloat16, device="cuda")
    pool2 = torch.empty((slots, *bank.w2.shape[2:]), dtype=torch.bfloat16, device="cuda")
    minus = lambda n: torch.full((n,), -1, dtype=torch.int64, device="cuda")  # noqa: E731
    ctl = DeviceControl(bank.w13, bank.w2, pool13, pool2, minus(layers * experts).view(layers, experts),
                        minus(slots), minus(slots), 0, 0.2)
    ctl.set_behind(1.0)
    for step in range(40):
        for layer in range(layers):
            ids = torch.randperm(6, generator=g)[:4].view(1, 4).cuda()   # 6 hot experts a layer
            ctl.step(layer, ids)
    torch.cuda.synchronize()
    assert ctl.behind.counters()["made_resident"] >= 4
    live = (ctl.slot_owner >= 0).nonzero().view(-1)
    owners = ctl.slot_owner[live].cpu()
    assert torch.equal(pool13[live].cpu(), bank.w13.view(-1, *bank.w13.shape[2:])[owners])
    assert torch.equal(pool2[live].cpu(), bank.w2.view(-1, *bank.w2.shape[2:])[owners])
    bank.unpin()


@pytest.mark.parametrize("model", ["qwen3_moe", "glm4_moe"])
def test_fills_behind_the_cpu_in_graphs_keep_the_tokens(tiny_checkpoint, model, monkeypatch):
    """FREETOKEN_FILL_BEHIND=on inside captured decode graphs with the CPU branch (q* 0.2, 12 of 16 experts in a
    cache): against the same graphs without it, the same tokens and float32 logits within 1e-4;
    experts were made resident behind the CPU and the cache's books balance."""
    folder = tiny_checkpoint(model)
    runs = []
    for mode in ("off", "on"):
        monkeypatch.setenv("FREETOKEN_FILL_BEHIND", mode)
        llm = LLM(folder, device="cuda", dtype="float32", expert_cache_experts=12, cpu_expert_fraction=0.8)
        tokens, logits = lockstep(llm, PROMPTS, 16)
        graphs = llm.runner.graphs
        assert graphs.replays >= 12
        assert {g.mode for (b, _), g in graphs._graphs.items() if b == len(PROMPTS)} == {"branch"}
        runs.append((tokens, logits, llm))
    (want, want_logits, _), (got, logits, llm) = runs
    assert got == want
    assert (logits - want_logits).abs().max() < 1e-4
    assert llm.runner.experts.control.behind.counters()["made_resident"] > 0
    s = llm.runner.expert_stats()
    assert s["fills"] + s["cpu_computed"] == s["misses"]
    llm.runner.experts.sync_stats()
    llm.runner.cache.check_integrity(deep=True)
