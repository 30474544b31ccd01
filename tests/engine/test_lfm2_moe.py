"""LFM2-MoE (``lfm2_moe``): the first LFM2 configs' form (``full_attn_idxs``, ``tie_embedding``),
the routing bias and the convolution's width each checked to matter, and configurations the
engine cannot follow refused by name. Parity with transformers on random checkpoints is also in
test_parity.py, the recurrent state (anchors, preemption, drafts) in test_hybrid.py and
test_speculative.py."""
from __future__ import annotations

import pytest

from freetoken_engine import LLM
from freetoken_engine.errors import ConfigError
from test_minimax_m2 import _edit
from test_parity import check
from tiny_models import copy_folder


def test_the_first_configs_form_reads_as_layer_types(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("lfm2_moe")
    folder = _edit(copy_folder(src, tmp_path / "old"), {"layer_types": None, "full_attn_idxs": [2],
                                                       "tie_word_embeddings": None, "tie_embedding": True})
    check(folder, n_new=16, ref_folder=src)


@pytest.mark.parametrize("part", ["bias", "width"])
def test_each_part_of_the_model_matters(tiny_checkpoint, tmp_path, part):
    src = tiny_checkpoint("lfm2_moe")
    folder = copy_folder(src, tmp_path / part)
    if part == "bias":
        _edit(folder, tensors=lambda s: [t.zero_() for k, t in s.items() if k.endswith("expert_bias")])
    else:          # the convolution read as one tap narrower: its first weight dropped
        _edit(folder, {"conv_L_cache": 2},
              tensors=lambda s: s.update({k: t[:, :, 1:].contiguous() for k, t in s.items() if k.endswith("conv.weight")}))
    with pytest.raises(AssertionError):
        check(folder, n_new=16, ref_folder=src)


@pytest.mark.parametrize("change,says", [
    ({"use_expert_bias": False}, "use_expert_bias false"),
    ({"layer_types": ["conv", "mamba", "full_attention", "conv"]}, "layer_types must name each of the 4 layers"),
])
def test_configurations_it_cannot_follow_are_refused_by_name(tiny_checkpoint, tmp_path, change, says):
    folder = _edit(copy_folder(tiny_checkpoint("lfm2_moe"), tmp_path / "l"), change)
    with pytest.raises(ConfigError, match=says):
        LLM(folder)
