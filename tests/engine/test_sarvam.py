"""Sarvam-30B and Param2 (``sarvam_moe``, ``param2moe``): GLM-4.5's model in Ling's tensor names.
Parity with transformers on random checkpoints is in test_parity.py (transformers reads the same
published names); here, the configs as published, in their own words and without the keys whose
defaults the family fixes, give the same tokens."""
from __future__ import annotations

import json

import pytest

from freetoken_engine import LLM, SamplingParams
from test_parity import PROMPT
from tiny_models import copy_folder

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("model_type", ["sarvam_moe", "param2moe"])
def test_the_published_config_words_and_defaults_give_the_same_tokens(tiny_checkpoint, tmp_path, model_type):
    src = tiny_checkpoint(model_type)
    cfg = json.loads((src / "config.json").read_text())
    want = LLM(src).generate(PROMPT, GREEDY).token_ids
    published = {({"n_routed_experts": "num_experts", "n_shared_experts": "num_shared_experts",
                   "attention_bias": "use_qkv_bias"}).get(k, k): v for k, v in cfg.items()}
    for key in ("use_qk_norm", "rope_parameters"):         # the family's defaults: q/k norms, the whole head rotates
        published.pop(key)
    published["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    folder = copy_folder(src, tmp_path / "p")
    (folder / "config.json").write_text(json.dumps(published))
    llm = LLM(folder)
    assert llm.runner.mcfg.qk_norm == "head" and llm.runner.mcfg.rope.partial_rotary_factor == 1.0
    assert llm.generate(PROMPT, GREEDY).token_ids == want
