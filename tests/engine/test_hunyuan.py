"""Hunyuan MoE (``hunyuan_v1_moe``) as published: the hub's config form (per-layer lists, the
NTK-alpha rotary under ``rope_scaling``), the q/k norms' place after the rotary and the alpha
each checked to matter, and configurations the engine cannot follow refused by name. Parity on
random checkpoints is also in test_parity.py, its decode through the fused kernel in
test_cpu_decode.py."""
from __future__ import annotations

from dataclasses import replace

import pytest

from freetoken_engine import LLM
from freetoken_engine.errors import ConfigError
from freetoken_engine.models import REGISTRY
from freetoken_engine.models.hunyuan_v1_moe import FAMILY, parse
from test_minimax_m2 import _edit
from test_parity import check
from tiny_models import copy_folder, uneven_norms

HUB = {"rope_parameters": None, "rope_theta": 10000.0,
       "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "type": "dynamic"},
       "num_experts": [8, 8], "moe_topk": [2, 2], "moe_intermediate_size": [16, 16], "num_shared_expert": [1, 1],
       "use_cla": False, "use_qk_norm": True, "use_mixed_mlp_moe": True}


def test_the_hubs_config_form_reads_as_transformers_reads_it(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("hunyuan_v1_moe")
    check(_edit(copy_folder(src, tmp_path / "hub"), HUB), n_new=16, ref_folder=src)


@pytest.mark.parametrize("part", ["norm_before_rotary", "alpha"])
def test_each_part_of_the_model_matters(tiny_checkpoint, tmp_path, part):
    """Broken one part at a time, the engine leaves transformers' logits: the q/k norms before
    the rotary (as every other family has them), the plain base without the alpha."""
    src = uneven_norms(copy_folder(tiny_checkpoint("hunyuan_v1_moe"), tmp_path / "src"),
                       ("query_layernorm.weight", "key_layernorm.weight"))
    check(src, n_new=16)
    folder = copy_folder(src, tmp_path / part)
    with pytest.MonkeyPatch.context() as mp:
        if part == "norm_before_rotary":
            mp.setitem(REGISTRY, "hunyuan_v1_moe", replace(FAMILY, parse=lambda raw: replace(parse(raw), qk_norm="head")))
        else:
            _edit(folder, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
        with pytest.raises(AssertionError):
            check(folder, n_new=16, ref_folder=src)


@pytest.mark.parametrize("change,says", [
    ({"use_cla": True}, "cross-layer attention"),
    ({"moe_topk": [2, 3]}, r"moe_topk differs between layers \(\[2, 3\]\)"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "without an alpha"),
])
def test_configurations_it_cannot_follow_are_refused_by_name(tiny_checkpoint, tmp_path, change, says):
    folder = _edit(copy_folder(tiny_checkpoint("hunyuan_v1_moe"), tmp_path / "h"), change)
    with pytest.raises(ConfigError, match=says):
        LLM(folder)
