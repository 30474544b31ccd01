"""Families on multi-head latent attention (``layers/mla.py``).

DeepSeek-V3 / V3.1 / R1 (``deepseek_v3``; Moonlight too, and Kimi-K2 / K2-Instruct publish the same
architecture under ``kimi_k2``, with Moonshot's tiktoken tokenizer, ``models/tiktoken_tokenizer.py``, and Sarvam-105B under
``sarvam_mla``): queries
through a ``q_lora_rank`` bottleneck, keys and values through a ``kv_lora_rank`` latent and one
shared rotated key; dense MLPs in the first ``first_k_dense_replace`` layers, then GLM's routing
(GLM-4.5 took it from here: sigmoid scores, a correction bias that steers the choice, group-
limited top k, weights times ``routed_scaling_factor``) and ``n_shared_experts`` shared experts;
a yarn rotary whose ``mscale_all_dim`` also scales every score. The checkpoint's MTP layer is the
layer after the model's own, as GLM's (``glm4_moe``).

DeepSeek-V2 / V2-Lite / V2.5 / Coder-V2 (``deepseek_v2``): the same attention (V2-Lite without
the query bottleneck), softmax routing without a correction bias, top k of all experts
(``topk_method`` "greedy") or within the ``topk_group`` groups whose best expert scores highest
("group_limited_greedy"), weights times ``routed_scaling_factor``, never renormalised
(``norm_topk_prob`` true is refused: transformers ignores it, and the published checkpoints set it
false).

GLM-4.7-Flash (``glm4_moe_lite``): the latent attention with GLM's routing; which layers are
dense is ``mlp_layer_types`` (by default the first).

Mistral 4 (``mistral4``: Mistral Small 4, as transformers holds its text model): V3's attention and
experts, softmax scores chosen within groups, no correction bias, and every query scaled by its
position past ``original_max_position_embeddings`` (``parse_mistral4``); ``mistral3``: the same
language model inside Mistral 3's multimodal wrapper, served as text (the vision tower unread).
"""
from __future__ import annotations

from dataclasses import replace

from ..config import LatentAttnConfig, ModelConfig
from ..errors import ConfigError
from . import glm4_moe
from .hf import Family, base, language_model, layer_kinds, moe, need


def _latent(raw: dict) -> dict:
    """The ``ModelConfig`` fields of a latent attention: its shape, one KV "head" of the rotated
    key and the latent, and every score's scale (yarn's ``mscale_all_dim`` squared)."""
    q_rank = raw.get("q_lora_rank")
    a = LatentAttnConfig(kv_rank=int(need(raw, "kv_lora_rank")), nope_dim=int(need(raw, "qk_nope_head_dim")),
                         rope_dim=int(need(raw, "qk_rope_head_dim")), v_dim=int(need(raw, "v_head_dim")),
                         q_rank=None if q_rank is None else int(q_rank),
                         interleaved=bool(raw.get("rope_interleave", True)))
    bias = bool(raw.get("attention_bias", False))
    return dict(mla=a, num_kv_heads=1, head_dim=a.cache_dim, qkv_bias=bias, o_bias=bias, qk_norm="none")


def _dense_first(raw: dict, default: int) -> tuple[int, ...]:
    layers = int(need(raw, "num_hidden_layers"))
    dense = int(raw.get("first_k_dense_replace", default) or 0)
    return tuple(range(min(dense, layers), layers))


def _mtp(raw: dict) -> dict:
    return dict(mtp_layers=int(raw.get("num_nextn_predict_layers") or 0), mtp_zero_first=True)


def parse_v3(raw: dict) -> ModelConfig:
    routed = glm4_moe._routed(raw, first_dense=3, norm_topk_prob=True)
    return ModelConfig(**base(raw, **_latent(raw), moe=routed, **_mtp(raw)))


def parse_sarvam_mla(raw: dict) -> ModelConfig:
    """Sarvam-105B (``sarvam_mla``): DeepSeek-V3's model under Sarvam's name; its first published
    config's legacy form read too (a ``rope_scaling`` of type "deepseek_yarn": yarn; ``head_dim``
    and ``q_head_dim`` derived anyway), as transformers reads it."""
    rope = raw.get("rope_scaling") or {}
    if "deepseek_yarn" in (rope.get("type"), rope.get("rope_type")):
        raw = raw | {"rope_scaling": {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "yarn"}}
    return parse_v3(raw)


def parse_axk1(raw: dict) -> ModelConfig:
    """SK Telecom's A.X-K1 (``axk1``): DeepSeek-V3 (the query bottleneck always) whose MoE layers'
    output is normed before the residual add (``post_mlp_layernorm``); which layers are dense is
    ``mlp_layer_types``, else the first ``first_k_dense_replace`` (1) and those off ``moe_layer_freq``."""
    layers = int(need(raw, "num_hidden_layers"))
    first, freq = int(raw.get("first_k_dense_replace", 1) or 0), int(raw.get("moe_layer_freq", 1) or 1)
    kinds = raw.get("mlp_layer_types") or ["sparse" if i >= first and i % freq == 0 else "dense" for i in range(layers)]
    kinds = layer_kinds("mlp_layer_types", kinds, layers, ("dense", "sparse"))
    cfg = parse_v3(raw | {"first_k_dense_replace": 0})
    return replace(cfg, moe=replace(cfg.moe, layers=tuple(i for i, k in enumerate(kinds) if k == "sparse")),
                   moe_post_norm=True)


def parse_v2(raw: dict) -> ModelConfig:
    method = raw.get("topk_method", "greedy") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ConfigError(f"config.json: DeepSeek-V2 topk_method {method!r} is not supported "
                          f"(greedy, group_limited_greedy)")
    if int(raw.get("moe_layer_freq", 1) or 1) != 1:
        raise ConfigError(f"config.json: moe_layer_freq {raw['moe_layer_freq']} is not supported (1: every layer "
                          f"after first_k_dense_replace)")
    if raw.get("norm_topk_prob"):
        raise ConfigError("config.json: DeepSeek-V2 with norm_topk_prob true is not supported (its routing weights "
                          "are the chosen experts' scores times routed_scaling_factor)")
    grouped = method == "group_limited_greedy"
    inter = int(need(raw, "moe_intermediate_size"))
    routed = moe(raw | {"num_experts": need(raw, "n_routed_experts")}, _dense_first(raw, 0), scoring="softmax",
                 biased=True, group_score="max", n_group=int(raw.get("n_group") or 1) if grouped else 1,
                 topk_group=int(raw.get("topk_group") or 1) if grouped else 1,
                 routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                 shared_intermediate_size=inter * int(raw.get("n_shared_experts") or 0))
    return ModelConfig(**base(raw, **_latent(raw), moe=routed))


def parse_mistral4(raw: dict) -> ModelConfig:
    """Mistral 4: V3's latent attention and experts (shared ones after ``first_k_dense_replace``
    dense layers), softmax scores chosen within the best groups (a group's worth its two best) and
    no correction bias (the biased router takes zeros, as V2's), every query times ``1 + beta
    log1p(floor(position / original_max))`` (``llama_4_scaling_beta``)."""
    routed = replace(glm4_moe._routed(raw, first_dense=0, norm_topk_prob=True), scoring="softmax")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    beta = rope.get("llama_4_scaling_beta")
    temper = None
    if beta:
        original = rope.get("original_max_position_embeddings")
        if not isinstance(original, (int, float)) or original < 1:
            raise ConfigError(f"config.json: llama_4_scaling_beta needs original_max_position_embeddings >= 1 in "
                              f"rope_parameters, got {original!r}")
        temper = (float(original), float(beta))
    return ModelConfig(**base(raw, **_latent(raw), moe=routed, position_temperature=temper))


def parse_mistral3(raw: dict) -> ModelConfig:
    """Mistral 3's multimodal wrapper around a Mistral 4 language model (Mistral Small 4 as
    published), served as text: its ``text_config``."""
    kind = (raw.get("text_config") or {}).get("model_type")
    if kind != "mistral4":
        raise ConfigError(f"config.json: a mistral3 model whose text_config is {kind!r} is not supported "
                          f"(mistral4: Mistral Small 4)")
    return parse_mistral4(language_model(raw, "mistral3"))


def _vision(cfg: ModelConfig, key: str) -> bool:
    return key.startswith(("vision_tower.", "multi_modal_projector."))


def parse_lite(raw: dict) -> ModelConfig:
    return ModelConfig(**base(raw, **_latent(raw), moe=glm4_moe.routed_by_kinds(raw, first_k=False), **_mtp(raw)))


def _source_v2(cfg: ModelConfig, name: str):
    """DeepSeek-V2's router has no correction bias: the engine's biased router takes zeros (the
    choice by plain scores); its shared experts are ``mlp.shared_experts``."""
    if name.endswith(".mlp.gate.e_score_correction_bias"):
        return name[:-len("e_score_correction_bias")] + "weight", lambda w: w.new_zeros(w.shape[0])
    return glm4_moe._source(cfg, name)


V3 = Family("deepseek_v3", parse_v3, source=glm4_moe._source, skip=glm4_moe.skip, mtp_layer=glm4_moe._mtp_layer)
V2 = Family("deepseek_v2", parse_v2, source=_source_v2)
MISTRAL4 = Family("mistral4", parse_mistral4, source=_source_v2)
AXK1 = Family("axk1", parse_axk1, source=glm4_moe._source, skip=glm4_moe.skip, mtp_layer=glm4_moe._mtp_layer)
SARVAM_MLA = Family("sarvam_mla", parse_sarvam_mla, source=glm4_moe._source, skip=glm4_moe.skip,
                    mtp_layer=glm4_moe._mtp_layer)
MISTRAL3 = Family("mistral3", parse_mistral3, source=_source_v2, model_prefix="language_model.model",
                  lm_head="language_model.lm_head.weight", skip=_vision)
GLM4_MOE_LITE = Family("glm4_moe_lite", parse_lite, source=glm4_moe._source, skip=glm4_moe.skip,
                       mtp_layer=glm4_moe._mtp_layer)
KIMI_K2 = replace(V3, model_type="kimi_k2")
FAMILIES = (V3, V2, GLM4_MOE_LITE, KIMI_K2, MISTRAL4, MISTRAL3, SARVAM_MLA, AXK1)
