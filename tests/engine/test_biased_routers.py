"""Families whose router chooses by score plus a correction bias: GLM-4.5 (``glm4_moe``) and
ERNIE-4.5 (``ernie4_5_moe``), as they are published: the router keeps float32 in a bfloat16
engine, ERNIE's MTP tensors stay out of a packed folder, and configurations the engine cannot
follow are refused clearly (GLM's MTP layer as a drafter: test_glm_mtp.py). Parity with transformers on random
checkpoints is in test_parity.py, the cache and q* split in test_expert_cache.py, stacked experts
in test_fused_experts.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.errors import ConfigError
from freetoken_engine.layers.moe import BiasedRouter
from freetoken_engine.packed.format import INDEX_NAME
from tiny_models import copy_folder, load_reference

PROMPT = [5, 17, 99, 200, 3, 44, 12, 300, 8, 9]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def test_mtp_drafts_from_a_layer_the_engine_does_not_run_are_refused_saying_what_to_use(tiny_checkpoint, tmp_path):
    """ERNIE-4.5's config names MTP layers the engine does not run (GLM's it does: test_glm_mtp.py)."""
    folder = copy_folder(tiny_checkpoint("ernie4_5_moe"), tmp_path / "ernie")
    cfg = json.loads((folder / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (folder / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "generate", "--model", str(folder),
                        "--prompt-ids", "1,2", "--max-new-tokens", "2", "--speculative-tokens", "2",
                        "--speculative-method", "mtp"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "ernie4_5_moe's multi-token-prediction layer" in r.stderr and "--speculative-method ngram" in r.stderr


@pytest.mark.parametrize("model_type", ["glm4_moe", "ernie4_5_moe"])
def test_bfloat16_keeps_the_router_in_float32_and_follows_transformers(tiny_checkpoint, model_type):
    """transformers keeps these routers (weight and correction bias) in float32 in a bfloat16
    model; so does the engine, and its greedy tokens start as transformers' bfloat16 ones do."""
    folder = tiny_checkpoint(model_type)
    llm = LLM(folder, dtype="bfloat16")
    routers = [m for m in llm.runner.model.modules() if isinstance(m, BiasedRouter)]
    assert routers and all(p.dtype == torch.float32 for r in routers for p in r.parameters())
    assert llm.runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    ref = load_reference(folder).to(torch.bfloat16)
    ref.generation_config.eos_token_id = None
    want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False, pad_token_id=0)[0, len(PROMPT):]
    got = llm.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)).token_ids
    assert got == want.tolist()


@pytest.mark.parametrize("change,says", [
    (dict(n_group=3), "n_group must divide the 8 routed experts"),
    (dict(topk_group=3), "topk_group must be in 1..n_group (2)"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "cannot hold num_experts_per_tok 3"),
])
def test_routing_it_cannot_follow_is_refused_clearly(tiny_checkpoint, tmp_path, change, says):
    folder = copy_folder(tiny_checkpoint("glm4_moe"), tmp_path / "glm")
    cfg = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as info:
        LLM(folder)
    assert says in str(info.value)


def test_ernie_with_biases_everywhere_is_refused_saying_why(tiny_checkpoint, tmp_path):
    """ERNIE-4.5's use_bias puts a bias on the LM head too, which the engine's head lacks; the
    published MoE checkpoints have none, so such a config is refused, not loaded wrong."""
    folder = copy_folder(tiny_checkpoint("ernie4_5_moe"), tmp_path / "ernie")
    cfg = json.loads((folder / "config.json").read_text()) | {"use_bias": True}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="use_bias"):
        LLM(folder)


def test_ernies_mtp_tensors_are_left_out_of_a_packed_folder(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("ernie4_5_moe")
    folder = copy_folder(src, tmp_path / "ernie")
    h = json.loads((folder / "config.json").read_text())["hidden_size"]
    save_file({"model.mtp_linear_proj.0.weight": torch.randn(h, 2 * h), "model.mtp_emb_norm.0.weight": torch.ones(h)},
              folder / "mtp.safetensors")
    with safe_open(folder / "model.safetensors", "pt") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    weight_map.update({"model.mtp_linear_proj.0.weight": "mtp.safetensors", "model.mtp_emb_norm.0.weight": "mtp.safetensors"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = tmp_path / "packed"
    r = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "convert", "--model", str(folder),
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not [k for k in json.loads((out / INDEX_NAME).read_text())["tensors"] if "mtp" in k]
    assert LLM(out).generate(PROMPT, GREEDY).token_ids == LLM(src).generate(PROMPT, GREEDY).token_ids
