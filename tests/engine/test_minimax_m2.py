"""MiniMax-M2 (``minimax_m2``) as published: the hub's config form, each part of the model
checked to matter, its FP8 blocks, and configurations the engine cannot follow refused by name.
Parity on random checkpoints is also in test_parity.py, the cache and q* split in
test_expert_cache.py."""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from freetoken_engine import LLM
from freetoken_engine.errors import ConfigError
from test_fp8_checkpoints import fp8_pair
from test_parity import check
from tiny_models import copy_folder


def _edit(folder, config: dict | None = None, tensors=None):
    if config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(config)
        for key in [k for k, v in config.items() if v is None]:
            del cfg[key]
        (folder / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        state = load_file(folder / "model.safetensors")
        tensors(state)
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_the_hubs_config_form_reads_as_transformers_reads_it(tiny_checkpoint, tmp_path):
    """MiniMax-M2's config.json names its partial rotary ``rotary_dim`` (no partial_rotary_factor)
    and carries rope_theta, qk_norm_type, scoring_func and the MTP fields at the top level."""
    src = tiny_checkpoint("minimax_m2")
    folder = _edit(copy_folder(src, tmp_path / "hub"), {
        "rope_parameters": None, "rope_theta": 5000000.0, "rotary_dim": 4, "use_qk_norm": True,
        "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True, "use_mtp": True,
        "num_mtp_modules": 3, "mtp_transformer_layers": 1, "shared_intermediate_size": 0})
    check(folder, n_new=16, ref_folder=src)


@pytest.mark.parametrize("part", ["bias", "qk_norm", "partial_rotary"])
def test_each_part_of_the_model_matters(tiny_checkpoint, tmp_path, part):
    """Broken one part at a time, the engine leaves transformers' logits: the parity test sees
    the routing bias, the whole-projection q/k norms and the rotary's width."""
    src = tiny_checkpoint("minimax_m2")
    folder = copy_folder(src, tmp_path / part)
    if part == "bias":
        _edit(folder, tensors=lambda s: [t.zero_() for k, t in s.items() if k.endswith("e_score_correction_bias")])
    elif part == "qk_norm":
        _edit(folder, tensors=lambda s: [t.mul_(2.0) for k, t in s.items() if k.endswith(("q_norm.weight",
                                                                                         "k_norm.weight"))])
    else:
        _edit(folder, {"rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                           "partial_rotary_factor": 1.0}, "rotary_dim": 8})
    with pytest.raises(AssertionError):
        check(folder, n_new=16, ref_folder=src)


def test_fp8_blocks_as_published_give_transformers_tokens(tiny_checkpoint, tmp_path):
    """MiniMax-M2 is published in FP8 only (e4m3, a float32 scale per 128x128 block; here 16x16
    so that the last blocks are partial): dequantized as read, transformers' tokens on the same
    dequantized weights."""
    src = tiny_checkpoint("minimax_m2", intermediate_size=24)
    folder, ref_dir = fp8_pair(src, tmp_path / "fp8", tmp_path / "ref")
    check(folder, n_new=12, ref_folder=ref_dir)


@pytest.mark.parametrize("change,says", [
    ({"qk_norm_type": "per_head"}, "qk_norm_type 'per_head'"),
    ({"use_qk_norm": False}, "use_qk_norm False"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"use_routing_bias": False}, "use_routing_bias false"),
    ({"shared_intermediate_size": 64}, "shared experts"),
])
def test_configurations_it_cannot_follow_are_refused_by_name(tiny_checkpoint, tmp_path, change, says):
    folder = _edit(copy_folder(tiny_checkpoint("minimax_m2"), tmp_path / "m"), change)
    with pytest.raises(ConfigError, match=says):
        LLM(folder)
