"""Mistral 4 (``mistral4``; ``mistral3``: Mistral Small 4 as published, inside Mistral 3's
multimodal wrapper): DeepSeek-V3's latent attention and experts, softmax routing within groups
without a correction bias, and every query scaled by its position past the original context.
Parity with transformers on random checkpoints is in the every-family suites (test_parity,
test_expert_cache); here what each part does, the wrapper's packed folder, concurrent requests
through a live service, and the refusals."""
from __future__ import annotations

import json

import pytest
import torch

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.errors import ConfigError
from freetoken_engine.packed import INDEX_NAME
from served import served_tokens
from test_parity import PROMPT, check, packed_and_cached
from tiny_models import edited_config


def test_queries_are_scaled_only_past_the_original_context(tiny_checkpoint, tmp_path):
    """The tiny config's original context is 4 positions: without the scaling (beta 0) the first
    four positions' logits stay, the later ones move; transformers agrees with both."""
    src = tiny_checkpoint("mistral4")
    flat = edited_config(src, tmp_path / "flat", lambda c: c["rope_parameters"].update(llama_4_scaling_beta=0.0))
    check(flat, n_new=8)
    scaled, plain = LLM(src).prefill_logits(PROMPT), LLM(flat).prefill_logits(PROMPT)
    assert torch.allclose(scaled[:4], plain[:4], atol=1e-6)
    assert (scaled[4:] - plain[4:]).abs().max() > 1e-2
    assert LLM(flat).runner.mcfg.position_temperature is None


def test_prompts_on_the_latent_are_scaled_too(tiny_checkpoint, monkeypatch):
    """The latent path (prompt chunks as decode steps run them) and chunked prefill give the
    expanded path's tokens."""
    from freetoken_engine.layers.mla import LatentAttention
    folder = tiny_checkpoint("mistral4")
    want = check(folder, n_new=12)
    monkeypatch.setattr(LatentAttention, "expand_prompts", False)
    assert check(folder, n_new=12) == want
    assert LLM(folder, prefill_chunk=3).generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0,
                                                                        ignore_eos=True)).token_ids == want


async def test_concurrent_requests_equal_each_alone(tiny_checkpoint):
    """Prompts prefilled 3 tokens at a time beside other requests' decode steps (the latent
    attention's mixed passes, each row scaled by its own position)."""
    folder = tiny_checkpoint("mistral4")
    prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + 3 * i)] for i in range(4)]
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    llm = LLM(folder)
    alone = [llm.generate(p, greedy).token_ids for p in prompts]
    assert await served_tokens(folder, prompts, greedy, max_batch=4, prefill_chunk=3) == alone


def test_the_published_wrapper_is_read_as_text_and_packed_without_its_vision_tower(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("mistral3")
    assert json.loads((src / "config.json").read_text())["text_config"]["model_type"] == "mistral4"
    packed_and_cached(src, tmp_path / "packed")
    index = (tmp_path / "packed" / INDEX_NAME).read_text()
    assert "language_model.model.layers.0.self_attn.q_a_proj.weight" in index
    assert "vision_tower." not in index and "multi_modal_projector." not in index


@pytest.mark.parametrize("model_type,change,needle", [
    ("mistral4", lambda c: c["rope_parameters"].pop("original_max_position_embeddings"),
     "llama_4_scaling_beta needs original_max_position_embeddings"),
    ("mistral3", lambda c: c["text_config"].update(model_type="mistral"),
     "a mistral3 model whose text_config is 'mistral' is not supported"),
])
def test_configs_the_engine_cannot_run_fail_with_what_to_fix(tiny_checkpoint, tmp_path, model_type, change, needle):
    folder = edited_config(tiny_checkpoint(model_type), tmp_path / "bad", change)
    with pytest.raises(ConfigError, match=needle):
        LLM(folder)
