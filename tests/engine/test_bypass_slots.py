"""Bypass slots of the expert cache (``cache/experts.py``): a fill that admission (or the slot
cap) refuses still crosses PCIe into a pool row outside the LRU, for its layer call only. The
device control step (Triton, under TRITON_INTERPRET=1) must equal the cache's torch step, the
residency must be exactly what it is without bypass slots, and the layer's outputs must not
change wherever each pair is computed."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import pytest  # noqa: E402
import torch  # noqa: E402

from freetoken_engine import env
from freetoken_engine.cache.bank import ExpertBank
from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.cache.experts import ExpertCache, bypass_slots
from freetoken_engine.kernels import reference

LAYERS, EXPERTS, H, I = 3, 12, 16, 8


def _bank(dtype=torch.float32) -> ExpertBank:
    bank = ExpertBank(LAYERS, EXPERTS, H, I, dtype)
    g = torch.Generator().manual_seed(4)
    bank.w13.copy_(0.3 * torch.randn(bank.w13.shape, generator=g))
    bank.w2.copy_(0.3 * torch.randn(bank.w2.shape, generator=g))
    return bank


def _cache(bank, bypass: int, capacity: int = 12) -> ExpertCache:
    # the cyclic scan below: 6 experts a layer, 18 > 9 LRU slots, nearly every miss filled
    return ExpertCache(bank, capacity, "cpu", fill_fraction=0.99, admit_window=LAYERS, bypass=bypass)


def _layer_output(bank, cache, layer, x, ids, pair_slot) -> torch.Tensor:
    """The pairs' rows: from the pool where the step put them on the device, else the bank."""
    tok = torch.arange(x.shape[0]).repeat_interleave(ids.shape[1])
    dev = pair_slot >= 0
    out = torch.empty(tok.numel(), H, dtype=x.dtype)
    out[dev] = reference.expert_pairs_forward(x, cache.w13, cache.w2, tok[dev], pair_slot[dev])
    out[~dev] = reference.expert_pairs_forward(x, bank.w13[layer], bank.w2[layer], tok[~dev],
                                               ids.reshape(-1)[~dev])
    return out


def test_refused_fills_cross_pcie_into_bypass_slots_and_residency_is_unchanged():
    bank = _bank()
    plain, ref, dev = _cache(bank, 0, capacity=9), _cache(bank, 3), _cache(bank, 3)
    assert (ref.capacity, ref.bypass, ref.lru_slots) == (12, 3, 9)
    ctl = DeviceControl.from_cache(dev)
    assert ctl.bypass == 3
    ids = torch.arange(6).view(2, 3)
    g = torch.Generator().manual_seed(1)
    bypassed = 0
    for step in range(5):
        for layer in range(LAYERS):
            x = torch.randn(2, H, generator=g)
            want = ref.step(layer, ids.reshape(-1))
            plain.step(layer, ids.reshape(-1))
            out = ctl.step(layer, ids)
            assert torch.equal(out.pair_slot, want), (step, layer)
            # bypassed pairs sit in the rows past the LRU, holding their experts' bank rows
            byp = want >= ref.lru_slots
            bypassed += int(byp.sum())
            for s, e in zip(want[byp].tolist(), ids.reshape(-1)[byp].tolist()):
                assert torch.equal(dev.w13[s], bank.w13[layer, e]) and torch.equal(ref.w13[s], bank.w13[layer, e])
            # and the layer's output is the bank's, exactly
            full = reference.expert_pairs_forward(x, bank.w13[layer], bank.w2[layer],
                                                  torch.arange(2).repeat_interleave(3), ids.reshape(-1))
            assert torch.equal(_layer_output(bank, ref, layer, x, ids, want), full)
            assert torch.equal(_layer_output(bank, dev, layer, x, ids, out.pair_slot), full)
    assert bypassed > 0
    # the device's residency, clocks and counters are the cache's, and the residency is the
    # same as without bypass slots: bypass fills never evict or become resident
    for name in ("slot_of", "slot_owner", "last_used"):
        assert torch.equal(getattr(ctl, name), getattr(ref, name))
        assert torch.equal(getattr(ref, name), getattr(plain, name))
    counters = ctl.counters()
    assert counters == {k: getattr(ref.stats, k) for k in counters}
    assert ref.stats.hits == plain.stats.hits and ref.stats.misses == plain.stats.misses
    # the refused fills moved from the CPU to PCIe
    assert ref.stats.fills == plain.stats.fills + bypassed
    assert ref.stats.cpu_computed == plain.stats.cpu_computed - bypassed
    ctl.write_back(dev)
    dev.check_integrity(deep=True)


def test_bypass_takes_at_most_the_refused_share():
    """Bypass never fills more than the q* rule asks for: with a fill fraction of 0.5 the CPU
    keeps its half of the misses."""
    bank = _bank()
    cache = ExpertCache(bank, 12, "cpu", fill_fraction=0.5, admit_window=LAYERS, bypass=3)
    ids = torch.arange(6).view(2, 3)
    for _ in range(3):
        for layer in range(LAYERS):
            before = cache.stats.cpu_computed, cache.stats.misses
            cache.step(layer, ids.reshape(-1))
            cpu, misses = cache.stats.cpu_computed - before[0], cache.stats.misses - before[1]
            assert cpu == misses - misses // 2 or cpu == misses // 2


def test_bypass_slots_rule_and_resize():
    assert bypass_slots(10, 10, 8) == 0            # every expert fits: no bypass
    assert bypass_slots(12, 36, 8) == 3            # at most a quarter of the pool
    assert bypass_slots(100, 360, 8) == 8
    bank = _bank()
    cache = _cache(bank, 3)
    cache.resize(20)
    assert (cache.capacity, cache.bypass, cache.lru_slots) == (20, 3, 17)
    assert cache.w13.shape[0] == 20 and cache.slot_owner.numel() == 17
    cache.resize(LAYERS * EXPERTS)
    assert cache.bypass == 0 and cache.lru_slots == LAYERS * EXPERTS
    ctl = DeviceControl.from_cache(cache)
    assert ctl.bypass == 0
    with pytest.raises(ValueError, match="bypass slots must be >= 0"):
        ExpertCache(bank, 12, "cpu", bypass=-1)


def test_bypass_env(monkeypatch):
    monkeypatch.delenv(env.FREETOKEN_BYPASS_SLOTS, raising=False)
    assert env.bypass_slots() == env.BYPASS_SLOTS_DEFAULT
    monkeypatch.setenv(env.FREETOKEN_BYPASS_SLOTS, "0")
    assert env.bypass_slots() == 0
    monkeypatch.setenv(env.FREETOKEN_BYPASS_SLOTS, "many")
    with pytest.raises(ValueError, match="FREETOKEN_BYPASS_SLOTS must be an integer >= 0, got 'many'"):
        env.bypass_slots()
