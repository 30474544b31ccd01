"""Sarvam-30B (``sarvam_moe``) and BharatGen's Param2-17B-A2.4B (``param2moe``): GLM-4.5's model
(``glm4_moe``: DeepSeek-V3's routing with a correction bias, shared experts after dense first
layers, per-head q/k RMSNorm) with the rotary over the whole head, published in Ling's (Bailing's)
tensor names: ``model.word_embeddings``, one fused ``attention.query_key_value`` projection (its
rows q, then k, then v, a bias beside it with ``use_qkv_bias``), ``attention.dense``,
``attention.query_layernorm`` / ``key_layernorm`` and the router's ``expert_bias``. Their configs
name the MoE in their own words (``num_experts``, ``num_shared_experts``, ``use_qkv_bias``,
``num_mtp_layers``); a key a config leaves out takes the family's default, as transformers does.
"""
from __future__ import annotations

import re
from dataclasses import replace

from ..config import ModelConfig
from . import glm4_moe
from .hf import Family

_RENAMED = {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts",
            "use_qkv_bias": "attention_bias", "num_mtp_layers": "num_nextn_predict_layers"}
_DEFAULTS = {
    "sarvam_moe": dict(head_dim=64, use_qk_norm=True, num_experts_per_tok=6, routed_scaling_factor=2.5,
                       first_k_dense_replace=1, n_shared_experts=1, rope_theta=8_000_000.0),
    "param2moe": dict(head_dim=64, use_qk_norm=True, num_experts_per_tok=6, routed_scaling_factor=2.5,
                      first_k_dense_replace=1, n_shared_experts=2, rope_theta=500_000.0, tie_word_embeddings=True),
}
_QKV = re.compile(r"^(.*\.)self_attn\.([qkv])_proj\.(weight|bias)$")
_NAMES = ((re.compile(r"^model\.embed_tokens\."), "model.word_embeddings."),
          (re.compile(r"\.self_attn\.o_proj\."), ".attention.dense."),
          (re.compile(r"\.self_attn\.q_norm\."), ".attention.query_layernorm."),
          (re.compile(r"\.self_attn\.k_norm\."), ".attention.key_layernorm."),
          (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.gate.expert_bias"))


def parse(raw: dict) -> ModelConfig:
    raw = {**_DEFAULTS[raw["model_type"]], **{_RENAMED.get(k, k): v for k, v in raw.items()}}
    cfg = glm4_moe.parse(raw)
    if "partial_rotary_factor" not in {**raw, **(raw.get("rope_parameters") or {})}:
        cfg = replace(cfg, rope=replace(cfg.rope, partial_rotary_factor=1.0))     # the whole head rotates
    return cfg


def _source(cfg: ModelConfig, name: str):
    """The engine's q/k/v are rows of the fused ``attention.query_key_value``; the rest renamed."""
    m = _QKV.match(name)
    if m:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[m.group(2)]
        return f"{m.group(1)}attention.query_key_value.{m.group(3)}", lambda t: t[start:start + size]
    for pattern, new in _NAMES:
        if pattern.search(name):
            return pattern.sub(new, name), lambda t: t
    return glm4_moe._source(cfg, name)


FAMILIES = tuple(Family(t, parse, source=_source, skip=glm4_moe.skip) for t in ("sarvam_moe", "param2moe"))
