"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash: ``layers/mla.py``), run on the
latent with the up-projections absorbed: transformers' tokens and logits (it expands every head's
keys and values) on variants of each family; each part of the mapping checked to matter; the KV
pool holding one latent per token; a packed folder, chunked prefill, the expert cache and q*, and
DeepSeek-V3's MTP layer as the drafter. Parity of the default tiny checkpoints is in
test_parity.py, the Triton path in test_triton_engine.py."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.config import RopeConfig
from freetoken_engine.errors import ConfigError
from freetoken_engine.models import REGISTRY
from freetoken_engine.packed import convert
from test_glm_mtp import drafts_are_the_references, glm_mtp_parts
from test_minimax_m2 import _edit
from test_mtp import PROMPTS
from test_parity import PROMPT, check
from test_scheduler import GREEDY, collect, prompts, service
from tiny_models import copy_folder, make_tiny_checkpoint

# DeepSeek-V3's published yarn (factor 40, mscale 1 over mscale_all_dim 1) at a tiny scale
YARN_V3 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
           "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
# DeepSeek-V2-Lite's (mscale 0.707 over 0.707)
YARN_V2 = dict(YARN_V3, mscale=0.707, mscale_all_dim=0.707, factor=8.0)


@pytest.mark.parametrize("model_type,overrides", [
    # the published yarn, its mscale_all_dim scaling every score; 4 groups, 2 kept, top 3
    ("deepseek_v3", dict(rope_parameters=YARN_V3, n_group=4, topk_group=2, num_experts_per_tok=3)),
    # no query bottleneck, the rotary in halves already, biases on the projections, no renormalisation
    ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, attention_bias=True, norm_topk_prob=False,
                         first_k_dense_replace=0, n_shared_experts=2)),
    # DeepSeek-V2 with a query bottleneck, top k of all experts, V2-Lite's yarn
    ("deepseek_v2", dict(q_lora_rank=12, topk_method="greedy", n_group=1, topk_group=1, rope_parameters=YARN_V2,
                         routed_scaling_factor=1.0, n_shared_experts=1)),
    # GLM-4.7-Flash: a dense layer between sparse ones, two groups of four with the best kept
    ("glm4_moe_lite", dict(mlp_layer_types=["sparse", "dense", "sparse"], n_group=2, topk_group=1,
                           routed_scaling_factor=1.8, num_experts_per_tok=3)),
    # values wider than the keys' unrotated and rotated parts together, 8 heads
    ("deepseek_v3", dict(v_head_dim=16, num_attention_heads=8, num_key_value_heads=8)),
])
def test_variants_match_transformers(tmp_path, model_type, overrides):
    check(make_tiny_checkpoint(tmp_path, model_type, seed=3, **overrides), n_new=16)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe_lite"])
def test_prompts_on_the_latent_give_the_expanded_forms_tokens(tiny_checkpoint, monkeypatch, model_type):
    """``LatentAttention.expand_prompts`` off (prompt chunks on the latent, as decode steps run):
    transformers' logits and tokens too, in one pass and in chunks of five."""
    from freetoken_engine.layers.mla import LatentAttention
    folder = tiny_checkpoint(model_type)
    want = check(folder, n_new=16)
    monkeypatch.setattr(LatentAttention, "expand_prompts", False)
    assert check(folder, n_new=16) == want
    greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    assert LLM(folder, prefill_chunk=5).generate(PROMPT, greedy).token_ids == want


def _scale_without_mscale(self, head_dim):
    return head_dim ** -0.5


@pytest.mark.parametrize("part", ["interleave", "mscale", "group_score", "value_width"])
def test_each_part_of_the_mapping_matters(tmp_path, monkeypatch, part):
    """Broken one at a time, the engine leaves transformers: the interleaved rotary read as halves,
    the softmax scale without yarn's mscale_all_dim, DeepSeek-V2's groups weighed by their two best
    experts (V3's rule), values read as wide as the keys' unrotated part."""
    model_type = "deepseek_v2" if part == "group_score" else "deepseek_v3"
    extra = dict(rope_parameters=YARN_V3) if part == "mscale" else {}
    src = make_tiny_checkpoint(tmp_path / "src", model_type, seed=3, **extra)
    folder = copy_folder(src, tmp_path / part)
    if part == "interleave":
        _edit(folder, {"rope_interleave": False})
    elif part == "mscale":
        monkeypatch.setattr(RopeConfig, "softmax_scale", _scale_without_mscale)
    elif part == "group_score":
        fam = REGISTRY[model_type]
        monkeypatch.setitem(REGISTRY, model_type, replace(fam, parse=lambda raw: _top2(fam.parse(raw))))
    else:
        _edit(folder, {"v_head_dim": 8})
    with pytest.raises((AssertionError, ConfigError)) as caught:
        check(folder, n_new=16, ref_folder=src)
    if part == "value_width":          # refused by shape, naming the tensor
        assert "kv_b_proj" in str(caught.value)


def _top2(cfg):
    assert cfg.moe.group_score == "max" and cfg.moe.n_group == 4
    return replace(cfg, moe=replace(cfg.moe, group_score="top2"))


def test_the_kv_pool_holds_one_latent_per_token(tiny_checkpoint):
    """Per token and layer the pool keeps the rotated key and the latent once, as key and as
    value: 4 + 16 values where the expanded heads would take 4 x (8 + 4 + 6)."""
    llm = LLM(tiny_checkpoint("deepseek_v3"))
    pool = llm.runner.kv
    k, v = pool.k, pool.v
    assert k.shape[2:] == (1, 4 + 16) and v.data_ptr() == k.data_ptr()
    assert pool.nbytes == k.shape[0] * k.shape[1] * (4 + 16) * k.element_size()
    cfg = llm.runner.mcfg
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (1, 20, 4)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_a_packed_folder_and_chunked_prefill_give_transformers_tokens(tiny_checkpoint, tmp_path, model_type):
    """``freetoken convert`` stores the checkpoint's projections as read (the rotary rows are put
    in order and the up-projection split as they load): transformers' logits and tokens, also
    with a prompt prefilled five tokens at a time."""
    src = tiny_checkpoint(model_type)
    out = convert(src, tmp_path / "packed", progress=False)
    want = check(out, n_new=16, ref_folder=src)
    chunked = LLM(src, prefill_chunk=5).generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0,
                                                                         ignore_eos=True))
    assert chunked.token_ids == want


@pytest.mark.parametrize("change,says", [
    ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
    ({"moe_layer_freq": 2}, "moe_layer_freq 2 is not supported"),
    ({"norm_topk_prob": True}, "norm_topk_prob true is not supported"),
    ({"kv_lora_rank": 0}, "kv_lora_rank must be positive"),
    ({"qk_rope_head_dim": 3}, "qk_rope_head_dim must be even"),
])
def test_configurations_it_cannot_follow_are_refused_by_name(tiny_checkpoint, tmp_path, change, says):
    folder = _edit(copy_folder(tiny_checkpoint("deepseek_v2"), tmp_path / "d"), change)
    with pytest.raises(ConfigError, match=says):
        LLM(folder)


def test_deepseek_v3_mtp_drafts_are_the_reference_drafts_and_change_no_token(tmp_path, monkeypatch):
    """DeepSeek-V3's MTP layer (its attention latent too) as the drafter: the drafts are the ones
    transformers' DeepSeek-V3 modules compute from the same weights, the tokens the plain decode's."""
    path = make_tiny_checkpoint(tmp_path / "v3", "deepseek_v3")
    drafts_are_the_references(path, glm_mtp_parts(path, family="deepseek_v3"), monkeypatch, PROMPTS[:1],
                              expert_cache_experts=5, cpu_expert_fraction=0.5)


async def test_batched_requests_and_a_reused_prefix_are_each_as_alone(tiny_checkpoint):
    """Through the scheduler: eight requests at once (decode tokens beside prompt chunks, the
    expert cache and q* on), then a second turn over the first's cached prefix; each answer is
    what the request gets alone."""
    folder = tiny_checkpoint("deepseek_v3")
    llm = LLM(folder)
    svc = service(folder, expert_cache_experts=5, cpu_expert_fraction=0.5, max_batch=8, prefill_chunk=8)
    try:
        batch = prompts(8)
        got = await asyncio.gather(*(collect(svc, p) for p in batch))
        assert got == [llm.generate(p, GREEDY).token_ids for p in batch]
        turn2 = batch[7] + got[7] + [11, 12]
        handle = svc.submit(turn2, GREEDY)
        out = [ev.token_id async for ev in handle if ev.token_id is not None]
        assert handle.cached_tokens >= 16 and out == llm.generate(turn2, GREEDY).token_ids
        svc.scheduler.check_integrity()
    finally:
        svc.shutdown()
