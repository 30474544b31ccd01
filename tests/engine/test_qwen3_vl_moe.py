"""Qwen3-VL-MoE checkpoints served as text, in the layout the hub publishes them: the language
model under ``model.language_model`` beside a vision tower (left unread), routed experts stacked
and stored transposed (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``), which transformers
also reads. Token for token with transformers in that layout, directly and after ``freetoken
convert``; transformers' own (untransposed) layout is the parity test's (test_parity.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.errors import ConfigError
from test_parity import PROMPT, check
from tiny_models import copy_folder

GREEDY = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)


def as_published(src, dst, transform=lambda t: t.transpose(1, 2)):
    """``src`` with each layer's stacked experts rewritten by ``transform`` (by default transposed
    into the hub's layout)."""
    folder = copy_folder(src, dst)
    state = load_file(folder / "model.safetensors")
    state = {k: (transform(t).contiguous() if ".mlp.experts." in k else t) for k, t in state.items()}
    save_file(state, folder / "model.safetensors")
    return folder


def test_the_hub_layout_matches_transformers_directly_and_packed(tiny_checkpoint, tmp_path):
    folder = as_published(tiny_checkpoint("qwen3_vl_moe"), tmp_path / "hub")
    down = load_file(folder / "model.safetensors")["model.language_model.layers.0.mlp.experts.down_proj"]
    assert tuple(down.shape[1:]) == (24, 32)                      # [E, I, H]: transposed
    tokens = check(folder, n_new=GREEDY.max_new_tokens)          # transformers reads that layout too
    out = tmp_path / "packed"
    r = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "convert", "--model", str(folder),
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert LLM(out, expert_cache_experts=3, cpu_expert_fraction=0.5).generate(PROMPT, GREEDY).token_ids == tokens


def test_experts_that_fit_neither_layout_are_refused_clearly(tiny_checkpoint, tmp_path):
    folder = as_published(tiny_checkpoint("qwen3_vl_moe"), tmp_path / "bad", transform=lambda t: t[:, :, :-2])
    with pytest.raises(ConfigError, match="config implies"):
        LLM(folder)


def test_a_text_request_to_the_multimodal_checkpoint_names_no_vision_weights(tiny_checkpoint):
    cfg = json.loads((tiny_checkpoint("qwen3_vl_moe") / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_vl_moe" and "vision_config" in cfg
    llm = LLM(tiny_checkpoint("qwen3_vl_moe"))
    names = [n for n, _ in llm.runner.model.named_parameters()]
    assert names and not any("visual" in n for n in names)


def test_glm_4_5v_is_served_as_text_and_packed_without_its_vision_tower(tiny_checkpoint, tmp_path):
    """GLM-4.5V (``glm4v_moe``): its language model (GLM-4.5-Air's) token for token with
    transformers, directly (test_parity.py) and packed; the packed folder holds no vision tensor."""
    from freetoken_engine.packed import convert
    from freetoken_engine.packed.format import INDEX_NAME
    src = tiny_checkpoint("glm4v_moe")
    assert any(k.startswith("model.visual.") for k in load_file(src / "model.safetensors"))
    out = convert(src, tmp_path / "packed", progress=False)
    tensors = json.loads((out / INDEX_NAME).read_text())["tensors"]
    assert tensors and not any(k.startswith("model.visual.") for k in tensors)
    check(out, n_new=GREEDY.max_new_tokens, ref_folder=src)
