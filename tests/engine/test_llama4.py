"""Llama 4 (``llama4``, ``llama4_text``): parity with transformers on random checkpoints (the text
model and the published multimodal wrapper; chunks of 4 positions, half the layers without
rotary and their queries tempered, one expert a token whose weight scales its input) is in
test_parity.py, through the expert cache in test_expert_cache.py; here the packed folder and the
configs' refusals."""
from __future__ import annotations


import pytest

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.errors import ConfigError
from freetoken_engine.packed import INDEX_NAME
from served import served_tokens
from test_parity import packed_and_cached
from tiny_models import edited_config


def test_a_packed_wrapper_folder_leaves_the_vision_tower_out_and_gives_the_same_tokens(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama4")
    packed_and_cached(src, tmp_path / "packed")
    index = (tmp_path / "packed" / INDEX_NAME).read_text()
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in index
    assert "vision_model." not in index and "multi_modal_projector." not in index


@pytest.mark.parametrize("change,needle", [
    (dict(num_experts_per_tok=2), "routing that scales the experts' input takes one expert a token; "
                                  "num_experts_per_tok is 2"),
    (dict(no_rope_layers=[1, 0]), "no_rope_layers must name each of the 4 layers"),
])
def test_a_config_the_engine_cannot_run_fails_with_what_to_fix(tiny_checkpoint, tmp_path, change, needle):
    folder = edited_config(tiny_checkpoint("llama4_text"), tmp_path / "p", lambda cfg: cfg.update(change))
    with pytest.raises(ConfigError, match=needle):
        LLM(folder)


async def test_concurrent_requests_in_odd_prefill_chunks_equal_each_alone(tiny_checkpoint):
    """Prompts prefilled 3 tokens at a time (so a pass's chunks start inside a 4-position attention
    chunk) beside other requests' decode steps: each request's tokens are its tokens alone."""
    folder = tiny_checkpoint("llama4_text")
    prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + 3 * i)] for i in range(5)]
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    llm = LLM(folder)
    alone = [llm.generate(p, greedy).token_ids for p in prompts]
    got = await served_tokens(folder, prompts, greedy, max_batch=4, prefill_chunk=3)
    assert got == alone
