"""Arcee's AFMoE (``afmoe``): with every norm's weights uneven (so that the four norms of a layer
and the two of its heads cannot stand in for each other), transformers' logits and tokens; the
sandwich norms, the global layers' missing position encoding, the attention's gate and the
routing bias each checked to matter; its layer-type list checked. Parity on random checkpoints
is also in test_parity.py, the Triton expert path in test_triton_engine.py."""
from __future__ import annotations

from dataclasses import replace

import pytest

from freetoken_engine import LLM
from freetoken_engine.errors import ConfigError
from freetoken_engine.models import REGISTRY
from freetoken_engine.models.afmoe import FAMILY, parse
from test_minimax_m2 import _edit
from test_parity import check
from tiny_models import copy_folder, uneven_norms

NORMS = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")


@pytest.fixture(scope="module")
def src(tiny_checkpoint, tmp_path_factory):
    return uneven_norms(copy_folder(tiny_checkpoint("afmoe"), tmp_path_factory.mktemp("afmoe") / "src"), NORMS)


def test_uneven_norms_give_transformers_tokens(src):
    check(src, n_new=16)


@pytest.mark.parametrize("part", ["sandwich", "nope", "gate", "bias"])
def test_each_part_of_the_model_matters(src, tmp_path, part):
    """Broken one part at a time, the engine leaves transformers' logits: the branch norms
    dropped (post_attention_layernorm taken as the norm before the MLP, as in other families),
    the global layers rotated, the attention's gate zeroed, the routing bias zeroed."""
    folder = copy_folder(src, tmp_path / part)
    with pytest.MonkeyPatch.context() as mp:
        if part in ("sandwich", "nope"):
            change = {"sandwich_norms": False} if part == "sandwich" else {"nope_layers": ()}
            mp.setitem(REGISTRY, "afmoe", replace(FAMILY, parse=lambda raw: replace(parse(raw), **change)))
        else:
            suffix = "gate_proj.weight" if part == "gate" else "expert_bias"
            _edit(folder, tensors=lambda s: [t.zero_() for k, t in s.items()
                                             if k.endswith(suffix) and ("self_attn" in k or part == "bias")])
        with pytest.raises(AssertionError):
            check(folder, n_new=16, ref_folder=src)


def test_a_layer_type_list_that_does_not_fit_is_refused(src, tmp_path):
    folder = _edit(copy_folder(src, tmp_path / "a"), {"layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(ConfigError, match="layer_types must name each of the 4 layers"):
        LLM(folder)
