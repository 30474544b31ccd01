"""Caching, offload and the q* split never change the output, and the cache keeps its invariants."""
from __future__ import annotations

import pytest
import torch

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.cache.bank import ExpertBank
from freetoken_engine.cache.experts import ExpertCache

PROMPT = [5, 17, 99, 200, 3, 44, 12, 300, 8, 9, 77, 150]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


def checked(llm: LLM) -> LLM:
    """Run the cache's integrity check (deep: slot rows equal bank rows) after every step."""
    cache = llm.runner.cache
    step = cache.step

    def step_and_check(layer, ids):
        out = step(layer, ids)
        cache.check_integrity(deep=True)
        resident = out >= 0
        assert torch.equal(cache.slot_of[layer, ids[resident]], out[resident])
        return out

    cache.step = step_and_check
    return llm


@pytest.mark.parametrize("model_type,capacities,fractions", [
    ("qwen3_moe", "all", (0.0, 0.5, 1.0)),
    ("qwen2_moe", "all", (0.0, 0.5, 1.0)),
    ("mixtral", "some", (0.5,)),
    ("olmoe", "some", (0.0, 1.0)),
    ("glm4_moe", "some", (0.0, 0.5, 1.0)),
    ("qwen3_vl_moe", "some", (0.5,)),
    ("ernie4_5_moe", "some", (0.0, 1.0)),
    ("dots1", "some", (0.5,)),
    ("minimax_m2", "some", (0.0, 0.5)),
    ("granitemoeshared", "some", (0.0, 0.5)),
    ("deepseek_v3", "some", (0.0, 0.5, 1.0)),
    ("deepseek_v2", "some", (0.5,)),
    ("glm4_moe_lite", "some", (0.5,)),
    ("kimi_linear", "some", (0.0, 0.5)),
    ("minicpm5_moe", "some", (0.5,)),
    ("sarvam_moe", "some", (0.5,)),
    ("phimoe", "some", (0.0, 0.5)),
    ("granitemoe_swa", "some", (0.5,)),
    ("flex_olmo", "some", (0.0, 0.5)),
    ("llama4_text", "some", (0.0, 0.5, 1.0)),
    ("ernie4_5_vl_moe", "some", (0.5,)),
    ("cohere2_moe", "some", (0.0, 0.5)),
    ("gpt_oss", "some", (0.0, 0.5, 1.0)),
    ("mistral4", "some", (0.0, 0.5)),
    ("mistral3", "some", (0.5,)),
    ("sarvam_mla", "some", (0.5,)),
    ("hy_v3", "some", (0.0, 0.5)),
    ("flint", "some", (0.0, 0.5)),
    ("axk1", "some", (0.5,)),
    ("kolibri1", "some", (0.0, 0.5)),
])
def test_same_tokens_for_every_capacity_and_cpu_fraction(tiny_checkpoint, model_type, capacities, fractions):
    folder = tiny_checkpoint(model_type)
    full = LLM(folder)
    total = full.runner.bank.total_experts
    want = full.generate(PROMPT, GREEDY).token_ids
    sizes = range(1, total + 1) if capacities == "all" else (1, 3, total // 2)
    for capacity in sizes:
        for fraction in fractions:
            llm = checked(LLM(folder, expert_cache_experts=capacity, cpu_expert_fraction=fraction))
            got = llm.generate(PROMPT, GREEDY)
            assert got.token_ids == want, (capacity, fraction)
            s = got.stats
            assert s["hits"] + s["misses"] > 0 and s["fills"] + s["cpu_computed"] == s["misses"]
            if fraction == 1.0:
                assert s["fills"] == 0                       # everything missed is computed in place
            if fraction == 0.0 and capacity >= llm.runner.mcfg.moe.num_experts:
                assert s["cpu_computed"] == 0                # a layer's experts all fit: all filled


def test_resize_between_steps_changes_nothing(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")
    llm = checked(LLM(folder, expert_cache_experts=8, cpu_expert_fraction=0.5))
    want = llm.generate(PROMPT, GREEDY).token_ids
    runner = llm.runner
    sizes = iter([1, 16, 3, 5, 2, 16, 7] * 10)
    forward = runner.forward

    def forward_then_resize(chunks):
        out = forward(chunks)
        runner.resize_expert_cache(next(sizes))
        runner.cache.check_integrity(deep=True)
        return out

    runner.forward = forward_then_resize
    assert llm.generate(PROMPT, GREEDY).token_ids == want


def _cache(capacity: int, layers: int = 2, experts: int = 6) -> ExpertCache:
    bank = ExpertBank(layers, experts, hidden=4, inter=2, dtype=torch.float32)
    bank.w13.copy_(torch.randn_like(bank.w13))
    bank.w2.copy_(torch.randn_like(bank.w2))
    return ExpertCache(bank, capacity, torch.device("cpu"))


def test_global_lru_evicts_least_recent_and_never_an_active_expert():
    cache = _cache(capacity=3)
    cache.step(0, torch.tensor([0, 1]))       # slots 0,1 <- (0,0),(0,1)
    cache.step(1, torch.tensor([2]))          # slot 2 <- (1,2)
    cache.step(0, torch.tensor([1]))          # touch (0,1)
    slots = cache.step(0, torch.tensor([1, 4]))   # (0,1) hit; (0,4) evicts LRU (0,0) at slot 0
    assert slots.tolist() == [1, 0]
    assert cache.slot_of[0, 0] == -1 and cache.slot_of[1, 2] == 2
    assert (cache.stats.hits, cache.stats.misses, cache.stats.fills) == (2, 4, 4)
    cache.check_integrity(deep=True)


def test_misses_beyond_free_slots_are_computed_in_place():
    cache = _cache(capacity=2)
    slots = cache.step(0, torch.tensor([0, 1, 2, 3]))
    assert (slots >= 0).sum() == 2 and cache.stats.cpu_computed == 2
    cache.check_integrity(deep=True)


def test_fill_fraction_splits_misses():
    cache = _cache(capacity=12)
    cache.fill_fraction = 0.5
    slots = cache.step(0, torch.tensor([0, 1, 2, 3]))
    assert slots.tolist() == [0, 1, -1, -1]               # first half (ascending ids) filled
    assert cache.stats.fills == 2 and cache.stats.cpu_computed == 2


def _cyclic_hits(admit_window: int | None, steps: int = 6) -> list[int]:
    """Hits per decode step when every step routes the same 4 experts in each of 3 layers (12
    experts) through 6 slots with almost every miss filled (q* = 0.99): plain LRU's worst case."""
    cache = _cache(capacity=6, layers=3)
    cache.fill_fraction = 0.99
    if admit_window is not None:
        cache.admit_window = admit_window
    hits = []
    for _ in range(steps):
        before = cache.stats.hits
        for layer in range(3):
            slots = cache.step(layer, torch.tensor([0, 1, 2, 3]))
            assert int((slots >= 0).sum()) <= 4
        hits.append(cache.stats.hits - before)
        cache.check_integrity(deep=True)
    return hits


def test_fill_admission_stops_the_cyclic_scan_from_evicting_every_expert():
    """cache/experts.py: plain LRU evicts each layer's experts just before the next step needs
    them (no hits at all); with admission (the default window: one step of 3 layers) the fills
    stop once every slot was used in the last step, and half the experts hit from then on."""
    assert _cyclic_hits(admit_window=0) == [0] * 6
    with_admission = _cyclic_hits(admit_window=None)
    assert with_admission[0] == 0 and with_admission[2:] == [6] * 4
    # fills-only caches (q* = 1) keep plain LRU: every miss must be filled there
    cache = _cache(capacity=6, layers=3)
    assert cache.admit_window == 3 and cache.window() == 0
    cache.fill_fraction = 0.5
    assert cache.window() == 3


def test_resize_keeps_most_recent_residents():
    cache = _cache(capacity=4)
    for e in range(4):
        cache.step(0, torch.tensor([e]))
    cache.resize(2)
    assert sorted(cache.slot_of[0].tolist()) == [-1, -1, -1, -1, 0, 1]
    assert cache.slot_of[0, 3] >= 0 and cache.slot_of[0, 2] >= 0
    cache.check_integrity(deep=True)
    cache.resize(6)
    cache.check_integrity(deep=True)
    assert cache.capacity == 6 and cache.resident() == 2


def test_fill_admission_switch(monkeypatch):
    """FREETOKEN_FILL_ADMISSION=off gives plain LRU victims (the A/B side); a typo is refused."""
    monkeypatch.setenv("FREETOKEN_FILL_ADMISSION", "off")
    assert _cache(capacity=6, layers=3).admit_window == 0
    monkeypatch.setenv("FREETOKEN_FILL_ADMISSION", "of")
    with pytest.raises(ValueError, match="FREETOKEN_FILL_ADMISSION"):
        _cache(capacity=6, layers=3)


@pytest.mark.parametrize("recur_window", [None, 0])
def test_a_miss_that_recurs_takes_the_fill_before_a_new_one(recur_window):
    """Under the q* split a single miss is computed on the CPU and not cached; when the next step
    routes to it again beside a new miss and q* fills one of the two, the recurring one is filled
    (it is likely to be routed again), not the lower id. ``recur_window=0``: ascending id only."""
    bank = ExpertBank(2, 8, 4, 2, torch.float32)
    cache = ExpertCache(bank, 4, "cpu", fill_fraction=0.4, recur_window=recur_window)
    assert cache.step(0, torch.tensor([5])).tolist() == [-1]          # one miss: the CPU's
    cache.step(1, torch.tensor([0]))                                    # the rest of the step
    slots = cache.step(0, torch.tensor([2, 5]))                         # two misses, one fill
    filled = 5 if recur_window is None else 2
    assert (slots >= 0).tolist() == [filled == 2, filled == 5]
    assert cache.slot_of[0, filled] >= 0 and cache.slot_of[0, 7 - filled] < 0
    assert cache.stats.fills == 1 and cache.stats.cpu_computed == 3
