"""OLMo 2 / OLMo 3 / FlexOlmo (``olmo2``, ``olmo3``, ``flex_olmo``): norms after each branch, OLMo
3's rotary per layer type. Parity with transformers on random checkpoints, with random norm
weights too, is in test_parity.py; here OLMo 3's two config forms and the refusals."""
from __future__ import annotations


import pytest

from freetoken_engine import LLM
from freetoken_engine.errors import ConfigError
from test_parity import check
from tiny_models import edited_config


def test_olmo3_flat_rope_scaling_scales_the_full_layers_only(tiny_checkpoint, tmp_path):
    """OLMo 3's published form: one ``rope_theta`` (500,000, as published) and a ``rope_scaling``
    (yarn) that only the full-attention layers take, the sliding ones rotating plainly: it gives
    transformers' logits, the two layer kinds told apart."""
    def flat(cfg):
        cfg["rope_theta"] = 500000.0
        cfg["rope_scaling"] = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)
        del cfg["rope_parameters"]
    folder = edited_config(tiny_checkpoint("olmo3"), tmp_path / "flat", flat)
    check(folder, n_new=8)
    cfg = LLM(folder).runner.mcfg
    assert [r.type for r in cfg.layer_ropes] == ["default", "default", "default", "yarn"]
    assert cfg.rope.type == "yarn" and cfg.sliding_window == (4, 4, 4, None)


def test_olmo3_without_a_rotary_for_a_layer_kind_fails_with_what_to_fix(tiny_checkpoint, tmp_path):
    folder = edited_config(tiny_checkpoint("olmo3"), tmp_path / "p",
                          lambda cfg: cfg["rope_parameters"].pop("full_attention"))
    with pytest.raises(ConfigError, match="rope_parameters names no rotary for full_attention layers"):
        LLM(folder)


def test_olmo3_layer_types_must_name_each_layer(tiny_checkpoint, tmp_path):
    folder = edited_config(tiny_checkpoint("olmo3"), tmp_path / "p",
                          lambda cfg: cfg.update(layer_types=["sliding_attention", "global"]))
    with pytest.raises(ConfigError, match="layer_types must name each of the 4 layers one of sliding_attention, "
                                          "full_attention"):
        LLM(folder)
