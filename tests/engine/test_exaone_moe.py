"""EXAONE MoE (``exaone_moe``): its global layers run without any position encoding, and the
parity test sees that, the sliding window and the routing bias stored on the MoE block; its
layer-type lists are checked. Parity on random checkpoints is also in test_parity.py, the
Triton path in test_triton_engine.py."""
from __future__ import annotations

from dataclasses import replace

import pytest

from freetoken_engine import LLM
from freetoken_engine.errors import ConfigError
from freetoken_engine.models import REGISTRY
from freetoken_engine.models.exaone_moe import FAMILY, parse
from test_minimax_m2 import _edit
from test_parity import check
from tiny_models import copy_folder


@pytest.mark.parametrize("part", ["nope", "window", "bias"])
def test_each_part_of_the_model_matters(tiny_checkpoint, tmp_path, part):
    """Broken one part at a time, the engine leaves transformers' logits: the global layers
    rotated (their NoPE ignored), the window widened past the text, the routing bias zeroed."""
    src = tiny_checkpoint("exaone_moe")
    folder = copy_folder(src, tmp_path / part)
    if part == "nope":
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(REGISTRY, "exaone_moe", replace(FAMILY, parse=lambda raw: _rotated(parse(raw))))
            with pytest.raises(AssertionError):
                check(folder, n_new=16, ref_folder=src)
        return
    if part == "window":
        _edit(folder, {"sliding_window": 512})
    else:
        _edit(folder, tensors=lambda s: [t.zero_() for k, t in s.items() if k.endswith("e_score_correction_bias")])
    with pytest.raises(AssertionError):
        check(folder, n_new=16, ref_folder=src)


def _rotated(cfg):
    if cfg.nope_layers != (1, 3):            # the tiny checkpoint's global layers
        raise RuntimeError(f"nope_layers {cfg.nope_layers}")
    return replace(cfg, nope_layers=())


@pytest.mark.parametrize("change,says", [
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types must name each of the 4 layers"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types must name each"),
])
def test_layer_type_lists_that_do_not_fit_are_refused(tiny_checkpoint, tmp_path, change, says):
    folder = _edit(copy_folder(tiny_checkpoint("exaone_moe"), tmp_path / "e"), change)
    with pytest.raises(ConfigError, match=says):
        LLM(folder)
