"""A prefill seeds the decode expert cache (cache/offload.py ``_seed_cache``, DeviceControl.seed):
after each MoE layer of a prefill-sized call, the experts of the call's last token are resident,
copied from the whole-layer weights the prefill used. The outputs, the cache's counters and the
experts a running decode used within the admission window are untouched. Triton's control step
runs under TRITON_INTERPRET=1 on CPU."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import pytest  # noqa: E402
import torch  # noqa: E402

from freetoken_engine.cache.bank import ExpertBank  # noqa: E402
from freetoken_engine.cache.experts import ExpertCache  # noqa: E402
from freetoken_engine.cache.offload import OffloadedExperts  # noqa: E402

LAYERS, EXPERTS, H, I, K, THRESHOLD = 3, 12, 32, 16, 4, 6


def _experts(monkeypatch, seed: str, capacity: int = 6) -> OffloadedExperts:
    monkeypatch.setenv("FREETOKEN_PREFILL_SEED", seed)
    monkeypatch.setenv("FREETOKEN_HOST_BRANCH", "off")          # CPU pairs through the per-layer path
    bank = ExpertBank(LAYERS, EXPERTS, H, I, torch.float32)
    g = torch.Generator().manual_seed(0)
    bank.w13.copy_(torch.randn(bank.w13.shape, generator=g))
    bank.w2.copy_(torch.randn(bank.w2.shape, generator=g))
    cache = ExpertCache(bank, capacity, "cpu", fill_fraction=0.5)
    experts = OffloadedExperts(bank, cache, THRESHOLD, cpu_backend="reference", backend="triton", top_k=K)
    assert experts.backend == "triton"
    return experts


def _routing(g: torch.Generator, tokens: int) -> torch.Tensor:
    return torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(tokens)])


def _prefill(experts: OffloadedExperts, g: torch.Generator, tokens: int = 8) -> tuple[list, list]:
    x = torch.randn(tokens, H, generator=g)
    ids = [_routing(g, tokens) for _ in range(LAYERS)]
    return [experts.forward(layer, x, ids[layer]) for layer in range(LAYERS)], ids


def test_prefill_leaves_the_last_tokens_experts_resident(monkeypatch):
    on, off = _experts(monkeypatch, "on", capacity=14), _experts(monkeypatch, "off", capacity=14)
    totals = on.control.totals.clone()
    out_on, ids = _prefill(on, torch.Generator().manual_seed(1))
    out_off, _ = _prefill(off, torch.Generator().manual_seed(1))
    for a, b in zip(out_on, out_off):                         # residency only: the same rows
        assert torch.equal(a, b)
    assert torch.equal(on.control.totals, totals)             # not counted as decode misses
    ctl, bank = on.control, on.bank
    for layer in range(LAYERS):
        slots = ctl.slot_of[layer, ids[layer][-1]]
        assert bool((slots >= 0).all()), f"layer {layer}: {ids[layer][-1].tolist()} -> {slots.tolist()}"
        for e, s in zip(ids[layer][-1].tolist(), slots.tolist()):
            assert torch.equal(ctl.w13_slots[s], bank.w13[layer, e])
            assert torch.equal(ctl.w2_slots[s], bank.w2[layer, e])
    # (the prefill's fill of the empty pool, fill_free, ran first and left some of them resident)
    assert 0 < on.seeded <= LAYERS * K and off.seeded == 0
    share = 14 // LAYERS                  # without the seed only fill_free's share of each layer
    assert bool(((off.control.slot_of >= 0).sum(1) == share).all())
    ctl.write_back(on.cache)
    on.cache.check_integrity(deep=True)


def test_seed_spares_a_running_decodes_experts(monkeypatch):
    """With fill admission on, a seed never evicts a slot a decode step used within the window
    (one step's layer calls), even when every other slot holds an expert of its own."""
    experts = _experts(monkeypatch, "on", capacity=8)
    g = torch.Generator().manual_seed(2)
    decode = [_routing(g, 1) for _ in range(LAYERS)]
    x = torch.randn(1, H, generator=g)
    for _ in range(3):                                        # a few decode steps on the same experts
        for layer in range(LAYERS):
            experts.forward(layer, x, decode[layer])
    ctl = experts.control
    used = {(layer, e) for layer in range(LAYERS) for e in decode[layer][0].tolist()
            if int(ctl.slot_of[layer, e]) >= 0}
    assert used, "the decode steps left nothing resident"
    _prefill(experts, g)
    for layer, e in used:
        assert int(ctl.slot_of[layer, e]) >= 0, f"seed evicted layer {layer} expert {e}"


@pytest.mark.parametrize("value", ["maybe", "1"])
def test_a_bad_switch_is_refused(monkeypatch, value):
    monkeypatch.setenv("FREETOKEN_PREFILL_SEED", value)
    from freetoken_engine import env
    with pytest.raises(ValueError, match="FREETOKEN_PREFILL_SEED"):
        env.prefill_seed()


def test_engine_tokens_do_not_depend_on_the_seed(tiny_checkpoint, monkeypatch):
    """The whole engine on the Triton path: a prompt long enough for the whole-layer prefill gives
    the same greedy tokens with the seed on and off, and the seed copied experts."""
    from freetoken_engine import LLM, SamplingParams
    folder = tiny_checkpoint("qwen3_moe")
    prompt = [(7 * i + 3) % 300 + 5 for i in range(40)]
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    got = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("FREETOKEN_PREFILL_SEED", mode)
        llm = LLM(folder, expert_backend="triton", expert_cache_experts=6, cpu_expert_fraction=0.5)
        got[mode] = (llm.generate(prompt, greedy).token_ids, llm.runner.experts.seeded)
    assert got["on"][0] == got["off"][0]
    assert got["on"][1] > 0 and got["off"][1] == 0


def test_only_a_prompts_last_chunk_seeds(tiny_checkpoint, monkeypatch):
    """A prompt prefilled in three whole-layer chunks seeds from its last chunk only: at most one
    token's experts per MoE layer (the earlier chunks' last tokens are not what decode needs)."""
    from freetoken_engine import LLM, SamplingParams
    monkeypatch.setenv("FREETOKEN_PREFILL_SEED", "on")
    monkeypatch.setattr(OffloadedExperts, "prefill_fills_free", False)   # the seed alone
    folder = tiny_checkpoint("qwen3_moe")
    llm = LLM(folder, expert_backend="triton", expert_cache_experts=12, cpu_expert_fraction=0.5, prefill_chunk=16,
              prefill_expert_threshold=16)
    prompt = [(11 * i + 5) % 300 + 5 for i in range(48)]
    llm.generate(prompt, SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True))
    layers, k = llm.runner.bank.w13.shape[0], 2
    assert 0 < llm.runner.experts.seeded <= layers * k


def test_whole_layer_calls_keep_no_pair_index(monkeypatch):
    """The [T * k] pair-token index is kept for decode-sized calls only (stable addresses for the
    graphs): a prompt's last step can have any size up to the GPU's 8192 tokens, and an index
    kept for every size would add up to gigabytes."""
    experts = _experts(monkeypatch, "off", capacity=14)
    g = torch.Generator().manual_seed(4)
    _prefill(experts, g, tokens=THRESHOLD + 2)
    assert (THRESHOLD + 2, K) not in experts._pair_tok
    experts.forward(0, torch.randn(1, H, generator=g), _routing(g, 1))
    assert (1, K) in experts._pair_tok
