"""IBM Granite 3.x (``granitemoe``, ``granitemoeshared``, ``granite``): each of its multipliers
checked to matter, a packed folder (whose bank holds the residual multiplier folded into the
experts' down weights) against transformers, and configurations the engine cannot follow refused.
Parity on random checkpoints is also in test_parity.py, the cache and q* split in
test_expert_cache.py, the Triton path in test_triton_engine.py."""
from __future__ import annotations

import pytest

from freetoken_engine import LLM
from freetoken_engine.errors import ConfigError
from freetoken_engine.packed import convert
from test_minimax_m2 import _edit
from test_parity import check
from tiny_models import copy_folder


@pytest.mark.parametrize("field,value", [("embedding_multiplier", 1.0), ("attention_multiplier", None),
                                         ("residual_multiplier", 1.0), ("logits_scaling", 1.0)])
@pytest.mark.parametrize("model_type", ["granitemoeshared", "granite"])
def test_each_multiplier_matters(tiny_checkpoint, tmp_path, model_type, field, value):
    """One multiplier left out (the config's field at its neutral value, or missing), the engine
    leaves transformers' logits: the parity test sees every one of them."""
    src = tiny_checkpoint(model_type)
    folder = _edit(copy_folder(src, tmp_path / field), {field: value})
    with pytest.raises(AssertionError):
        check(folder, n_new=16, ref_folder=src)


@pytest.mark.parametrize("model_type", ["granitemoeshared", "granite"])
def test_a_packed_folder_gives_transformers_tokens(tiny_checkpoint, tmp_path, model_type):
    """``freetoken convert`` writes the experts' down weights with the residual multiplier folded
    in and the dense tensors as read (folded as they load): transformers' logits and tokens."""
    src = tiny_checkpoint(model_type)
    out = convert(src, tmp_path / "packed", progress=False)
    check(out, n_new=16, ref_folder=src)


@pytest.mark.parametrize("change,says", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"residual_multiplier": 0.0}, "residual_multiplier must be a positive number"),
    ({"logits_scaling": -6.0}, "logits_scaling must be a positive number"),
    ({"shared_intermediate_size": 16}, r"shared_mlp.input_linear.weight has shape \(48, 32\)"),
])
def test_configurations_it_cannot_follow_are_refused_by_name(tiny_checkpoint, tmp_path, change, says):
    folder = _edit(copy_folder(tiny_checkpoint("granitemoeshared"), tmp_path / "g"), change)
    with pytest.raises(ConfigError, match=says):
        LLM(folder)
