"""The engine against transformers, token for token, on checkpoints it has never seen."""
from __future__ import annotations

import pytest
import torch

from freetoken_engine import LLM, SamplingParams
from tiny_configs import SUPPORTED
from tiny_models import copy_folder, load_reference, make_tiny_checkpoint, uneven_norms

PROMPT = [5, 17, 99, 200, 3, 44, 12, 300, 8, 9, 77, 150]


def reference_greedy(ref, ids: list[int], n: int) -> list[int]:
    ref.generation_config.eos_token_id = None      # compare raw greedy continuations
    out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def check(folder, n_new: int = 32, tol: float = 1e-4, ref_folder=None, **engine_options):
    """The engine on ``folder`` against transformers on ``ref_folder`` (default: the same):
    whole-prompt and token-by-token logits within ``tol``, and ``n_new`` greedy tokens equal.
    Returns those tokens."""
    ref = load_reference(ref_folder or folder)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    llm = LLM(folder, **engine_options)
    assert (llm.prefill_logits(PROMPT) - want).abs().max() < tol      # whole-prompt path
    assert (llm.forward_logits(PROMPT) - want).abs().max() < tol      # token-by-token decode path
    got = llm.generate(PROMPT, SamplingParams(max_new_tokens=n_new, temperature=0, ignore_eos=True))
    assert got.token_ids == reference_greedy(ref, PROMPT, n_new)
    return got.token_ids


def packed_and_cached(src, packed_dir, n_new: int = 16) -> None:
    """``freetoken convert``'s folder of ``src`` gives transformers' tokens on ``src``, and the expert
    cache at three capacities and CPU fractions gives them too, every miss filled or computed."""
    from freetoken_engine.packed import convert
    want = check(convert(src, packed_dir, progress=False), n_new=n_new, ref_folder=src)
    greedy = SamplingParams(max_new_tokens=n_new, temperature=0, ignore_eos=True)
    for capacity, fraction in ((1, 0.0), (3, 0.5), (5, 1.0)):
        got = LLM(src, expert_cache_experts=capacity, cpu_expert_fraction=fraction).generate(PROMPT, greedy)
        assert got.token_ids == want
        assert got.stats["fills"] + got.stats["cpu_computed"] == got.stats["misses"] > 0


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_every_family_matches_transformers(tiny_checkpoint, model_type):
    check(tiny_checkpoint(model_type))


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_every_family_matches_transformers_with_uneven_norms(tiny_checkpoint, tmp_path, model_type):
    """Every norm's weights random: a checkpoint starts them at one, where two norms read in each
    other's place (or a norm on the wrong side of the rotary) give the same numbers. On the
    hybrids, the engine's decode recurrence and transformers' chunked form part by up to 1.2e-3
    here: transformers' own recurrent and chunked forms part by 2.7e-4 on the same checkpoint."""
    folder = uneven_norms(copy_folder(tiny_checkpoint(model_type), tmp_path / "uneven"), ("norm.weight",))
    check(folder, n_new=16, tol=2e-3 if model_type in ("qwen3_next", "qwen3_5_moe_text") else 1e-4)


@pytest.mark.parametrize("model_type,overrides", [
    ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=1, norm_topk_prob=False)),
    ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=6, norm_topk_prob=True, hidden_size=48)),
    ("qwen3_moe", dict(num_experts_per_tok=3, norm_topk_prob=False, tie_word_embeddings=True)),
    ("qwen3_moe", dict(decoder_sparse_step=2, num_hidden_layers=3)),          # dense + sparse layers
    ("qwen2_moe", dict(num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=3)),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=1, num_key_value_heads=1)),
    ("olmoe", dict(num_experts_per_tok=3, norm_topk_prob=True, clip_qkv=0.5)),
    # GLM-4.5-Air's shape of routing (one group, top k of all), no q/k norm, two shared experts
    ("glm4_moe", dict(n_group=1, topk_group=1, use_qk_norm=False, n_shared_experts=2, first_k_dense_replace=2,
                      num_hidden_layers=4, norm_topk_prob=False, routed_scaling_factor=1.0)),
    ("glm4_moe", dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=0,
                      attention_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                             "partial_rotary_factor": 1.0})),
    ("qwen3_vl_moe", dict(tie_word_embeddings=True, num_experts_per_tok=3, decoder_sparse_step=2,
                          num_hidden_layers=3)),
    ("ernie4_5_moe", dict(moe_layer_start_index=0, moe_layer_interval=2, num_hidden_layers=4, moe_num_shared_experts=0,
                          moe_k=3, tie_word_embeddings=False)),
    ("dots1", dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=4,
                   norm_topk_prob=True, n_group=1, topk_group=1, attention_bias=False)),
    # Solar Open: q/k/v biases, two shared experts, one group, top 3, a routed scaling
    ("solar_open", dict(attention_bias=True, n_shared_experts=2, n_group=1, num_experts_per_tok=3,
                        routed_scaling_factor=1.5, num_key_value_heads=1)),
    # EXAONE MoE: three sliding layers to one global, dense layers named by mlp_layer_types, two
    # groups of four with both kept; then explicit layer types
    ("exaone_moe", dict(sliding_window_pattern=4, mlp_layer_types=["sparse", "dense", "sparse", "sparse"],
                        topk_group=2, num_experts_per_tok=3, routed_scaling_factor=1.0)),
    ("exaone_moe", dict(layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=3,
                        num_shared_experts=2, num_key_value_heads=1)),
    # Hunyuan: one KV head, top 3, tied embeddings (as Hunyuan-A13B)
    ("hunyuan_v1_moe", dict(num_key_value_heads=1, moe_topk=3, tie_word_embeddings=True)),
    # AFMoE: muP's embedding scale, explicit layer types, two dense layers, biases on q/k/v/o, one
    # shared expert
    ("afmoe", dict(mup_enabled=True, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                  "sliding_attention"], num_dense_layers=2, attention_bias=True,
                   num_shared_experts=1, route_scale=1.0, num_experts_per_tok=3)),
    # MiniMax-M2: the rotary over whole heads, one KV head, top 3 renormalised
    ("minimax_m2", dict(rotary_dim=8, num_key_value_heads=1, num_experts_per_tok=3, rope_parameters={
        "rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 1.0})),
    # Granite: one expert, q/k/v/o biases (o_proj's scaled with its weight), untied LM head, one KV
    # head; the published multipliers (12, 1/64, 0.22, 6) with a shared expert
    ("granitemoe", dict(num_experts_per_tok=1, attention_bias=True, tie_word_embeddings=False, num_key_value_heads=1)),
    ("granitemoeshared", dict(embedding_multiplier=12.0, attention_multiplier=1 / 64, residual_multiplier=0.22,
                              logits_scaling=6.0, num_experts_per_tok=3)),
    ("granite", dict(attention_bias=True, tie_word_embeddings=False)),
    ("llama", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    ("qwen3_moe", dict(max_position_embeddings=128, rope_parameters={                   # YaRN (Qwen3 long context)
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})),
    ("llama", dict(max_position_embeddings=512, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 2.0, "original_max_position_embeddings": 256,
        "beta_fast": 16.0, "beta_slow": 2.0})),
    ("qwen3", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    # Qwen2.5: sliding layers from max_window_layers on, tied embeddings; Mistral without a window
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1, tie_word_embeddings=True)),
    ("mistral", dict(sliding_window=None, num_key_value_heads=1)),
])
def test_unseen_variants_match(tmp_path, model_type, overrides):
    check(make_tiny_checkpoint(tmp_path, model_type, seed=3, **overrides), n_new=16)


def test_sharded_checkpoint_matches(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "qwen2_moe", seed=5, shard_kb=20)
    assert len(list(folder.glob("*.safetensors"))) > 3
    check(folder, n_new=16)


def test_chunked_prefill_equals_one_pass(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")
    whole = LLM(folder).generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    chunked = LLM(folder, prefill_chunk=5).generate(
        PROMPT, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    assert chunked.token_ids == whole.token_ids


def test_sampling_is_reproducible_by_seed(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("qwen3_moe"))
    params = dict(max_new_tokens=16, temperature=0.9, top_p=0.9, top_k=50, ignore_eos=True)
    a = llm.generate(PROMPT, SamplingParams(seed=1, **params)).token_ids
    b = llm.generate(PROMPT, SamplingParams(seed=1, **params)).token_ids
    c = llm.generate(PROMPT, SamplingParams(seed=2, **params)).token_ids
    assert a == b and a != c


def test_generation_stops_on_eos(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("qwen3_moe"))
    greedy = llm.generate(PROMPT, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)).token_ids
    stop_at = greedy[5]
    out = llm.generate(PROMPT, SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=(stop_at,)))
    assert out.token_ids == greedy[:greedy.index(stop_at) + 1] and out.finish_reason == "stop"


def test_the_grouped_matmul_attention_switch_matches_transformers(tiny_checkpoint, monkeypatch):
    """``Attention.sdpa = False`` (the path before SDPA, kept for bench/cpu_prefill_attention.py's
    A/B) still matches transformers, so that benchmark compares two correct computations."""
    from freetoken_engine.layers.attention import Attention
    monkeypatch.setattr(Attention, "sdpa", False)
    check(tiny_checkpoint("qwen3_moe"), n_new=8)
