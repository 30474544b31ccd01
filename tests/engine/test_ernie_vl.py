"""ERNIE-4.5-VL served as text (``ernie4_5_vl_moe``). Parity with transformers' multimodal class on
text (a random checkpoint whose vision experts, router and correction-bias row are as random as
the text set's, so reading the wrong set shows) is in test_parity.py; here the published config's
form and a packed folder without the vision parts."""
from __future__ import annotations

import json

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.packed import INDEX_NAME
from test_parity import PROMPT, packed_and_cached
from tiny_models import edited_config

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def test_the_published_config_form_gives_the_same_tokens(tiny_checkpoint, tmp_path):
    """Baidu's config names each set's sizes in lists (``moe_num_experts: [E, E]``) and the MoE
    layers by ``moe_layer_start_index``, where transformers writes ``mlp_layer_types``."""
    src = tiny_checkpoint("ernie4_5_vl_moe")
    want = LLM(src).generate(PROMPT, GREEDY).token_ids
    text = json.loads((src / "config.json").read_text())["text_config"]
    assert text["mlp_layer_types"] == ["dense", "sparse", "sparse"]

    def published(cfg):
        del cfg["text_config"]["mlp_layer_types"]
        cfg["text_config"].update(moe_layer_start_index=1, moe_num_experts=[text["moe_num_experts"]] * 2)
    folder = edited_config(src, tmp_path / "p", published)
    llm = LLM(folder)
    assert llm.runner.mcfg.moe.layers == (1, 2) and llm.runner.mcfg.moe.num_experts == 8
    assert llm.generate(PROMPT, GREEDY).token_ids == want


def test_a_packed_folder_holds_the_text_model_only(tiny_checkpoint, tmp_path):
    packed_and_cached(tiny_checkpoint("ernie4_5_vl_moe"), tmp_path / "packed")
    index = (tmp_path / "packed" / INDEX_NAME).read_text()
    assert "model.layers.1.mlp.gate.weight" in index
    assert "vision_model." not in index and "gate.weight_1" not in index and "experts.8." not in index
