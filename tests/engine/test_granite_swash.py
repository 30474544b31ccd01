"""Granite swash (``granitemoe_swa``, ``granite_swa``): attention sinks, sliding-window layers and
a rotary base per layer. Parity with transformers on random checkpoints (random sinks, a layer
without position encoding, two bases, a window of 4) is in test_parity.py; here the sinks through
every attention path of the engine, the configs' refusals, and Granite's default multiplier."""
from __future__ import annotations


import pytest
import torch

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.errors import ConfigError
from freetoken_engine.layers import sinks as S
from served import served_tokens
from test_parity import check
from tiny_models import edited_config, load_reference

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
LONG = [(11 * i) % 300 + 3 for i in range(40)]


@pytest.mark.parametrize("flash", [True, False], ids=["flash-lse", "held-scores"])
def test_both_prompt_paths_give_transformers_logits(tiny_checkpoint, monkeypatch, flash):
    """A prompt's chunk through the CPU's flash kernel and its log-sum-exp, and through held
    float32 scores (a GPU's path) a bounded number of query rows at a time: a 40-token prompt in
    blocks of two rows gives the logits of one block, and both give transformers'."""
    folder = tiny_checkpoint("granitemoe_swa")
    ref = load_reference(folder)
    with torch.no_grad():
        want = ref(torch.tensor([LONG])).logits[0]
    monkeypatch.setattr(S, "FLASH_LSE", flash)
    whole = LLM(folder).prefill_logits(LONG)
    assert (whole - want).abs().max() < 1e-4
    if not flash:
        monkeypatch.setattr(S, "BLOCK_BYTES", 4 * 4 * 40 * 2)          # two query rows of 4 heads x 40 keys
        assert (LLM(folder).prefill_logits(LONG) - whole).abs().max() < 1e-5


def test_the_sink_softmax_is_the_sink_column_dropped_and_a_masked_row_is_zero():
    scores = torch.tensor([[1.0, 2.0, float("-inf")], [float("-inf")] * 3])
    sink = torch.tensor([[0.5], [3.0]])
    got = S.softmax(scores, sink)
    want = torch.softmax(torch.cat((scores[:1], sink[:1]), -1), -1)[:, :-1]
    torch.testing.assert_close(got[:1], want)
    assert torch.equal(got[1], torch.zeros(3))


async def test_concurrent_requests_with_sinks_equal_each_alone(tiny_checkpoint):
    """Prompts' chunks beside other sequences' decode tokens (the mixed pass: the fused decode
    kernel for the single tokens, the chunks on their own) and several sequences decoding at once,
    every softmax with its sink: each request's tokens are its tokens alone."""
    folder = tiny_checkpoint("granitemoe_swa")
    prompts = [LONG[:6 + 3 * i] for i in range(6)]
    llm = LLM(folder)
    alone = [llm.generate(p, GREEDY).token_ids for p in prompts]
    got = await served_tokens(folder, prompts, GREEDY, max_batch=4, prefill_chunk=8)
    assert got == alone


@pytest.mark.parametrize("thetas,needle", [
    ([10000.0, 0, 500.0], "layer_rope_theta must give each of the 4 layers a rotary base >= 0"),
    ([10000.0, -1.0, 500.0, 10000.0], "layer_rope_theta must give each of the 4 layers"),
    ("10000", "layer_rope_theta must be a list of numbers"),
])
def test_a_broken_layer_rope_theta_fails_with_what_to_fix(tiny_checkpoint, tmp_path, thetas, needle):
    folder = edited_config(tiny_checkpoint("granitemoe_swa"), tmp_path / "p",
                           lambda cfg: cfg.update(layer_rope_theta=thetas))
    with pytest.raises(ConfigError, match=needle):
        LLM(folder)


def test_a_granite_config_without_attention_multiplier_scales_as_transformers_does(tiny_checkpoint, tmp_path):
    """transformers' Granite configs default ``attention_multiplier`` to 1.0 (not head_dim ** -0.5):
    a config that leaves it out reads as transformers reads it."""
    folder = edited_config(tiny_checkpoint("granitemoeshared"), tmp_path / "p",
                           lambda cfg: cfg.pop("attention_multiplier"))
    assert LLM(folder).runner.mcfg.attention_multiplier == 1.0
    check(folder, n_new=8)
