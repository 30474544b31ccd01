"""Cohere's MoE (``cohere2_moe``). The default form (softmax selection, shared experts averaged,
LayerNorm) is in test_parity.py's every-family suites; here the config's other choices against
transformers, and the refusals."""
from __future__ import annotations


import pytest

from freetoken_engine import LLM
from freetoken_engine.errors import ConfigError
from test_parity import check
from tiny_models import edited_config


@pytest.mark.parametrize("overrides", [
    dict(expert_selection_fn="sigmoid"),                    # sigmoids of the top logits, renormalised
    dict(expert_selection_fn="sigmoid", norm_topk_prob=False),
    dict(shared_expert_combination_strategy="sum"),
    dict(rms_norm_eps=1e-6),                                # an RMSNorm instead of the LayerNorm
    dict(prefix_dense_sliding_window_pattern=2, first_k_dense_replace=2),   # a global dense layer: no rotary
], ids=["sigmoid", "sigmoid-unnormalised", "sum", "rmsnorm", "prefix-pattern"])
def test_each_config_choice_gives_transformers_tokens(tiny_checkpoint, overrides):
    check(tiny_checkpoint("cohere2_moe", **overrides), n_new=16)


@pytest.mark.parametrize("change,needle", [
    (dict(expert_selection_fn="relu"), "expert_selection_fn 'relu'"),
    (dict(shared_expert_combination_strategy="max"), "shared_expert_combination_strategy 'max'"),
])
def test_a_choice_the_engine_does_not_know_fails_with_what_to_fix(tiny_checkpoint, tmp_path, change, needle):
    folder = edited_config(tiny_checkpoint("cohere2_moe"), tmp_path / "p", lambda cfg: cfg.update(change))
    with pytest.raises(ConfigError, match=needle):
        LLM(folder)
