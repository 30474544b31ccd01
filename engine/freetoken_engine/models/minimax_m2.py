"""MiniMax-M2 (MiniMax-M2, M2.1): Mixtral's layout with DeepSeek-style routing.

Sigmoid scores; the per-expert ``e_score_correction_bias`` (stored on the MoE block, not its
gate) steers which experts are chosen, not how they weigh; the chosen scores renormalised, no
groups, no scaling. q/k RMSNorm over the whole projection before the rotary (``qk_norm_type``
``per_layer``), rotary over the first ``rotary_dim`` of each head, 48/8 heads of 128, no shared
experts, every layer sparse. The hub's experts are ``block_sparse_moe.experts.{e}.w1/w3/w2``
(published as FP8 blocks, which ``models/loader`` dequantizes as it reads them). The
multi-token-prediction modules the config names (``use_mtp``) are not run.
"""
from __future__ import annotations

import re
from dataclasses import replace

from ..config import ModelConfig
from ..errors import ConfigError
from .hf import Family, base, moe

_BIAS = re.compile(r"^(model\.layers\.\d+\.mlp\.)gate\.e_score_correction_bias$")


def parse(raw: dict) -> ModelConfig:
    if raw.get("qk_norm_type", "per_layer") != "per_layer" or raw.get("use_qk_norm") is False:
        raise ConfigError(f"config.json: MiniMax-M2 with qk_norm_type {raw.get('qk_norm_type')!r}, use_qk_norm "
                          f"{raw.get('use_qk_norm')!r} is not supported; the published checkpoints norm q and k "
                          "over the whole projection (per_layer)")
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"config.json: MiniMax-M2 with scoring_func {raw['scoring_func']!r} is not supported "
                          "(sigmoid only, as published)")
    if raw.get("use_routing_bias") is False:
        raise ConfigError("config.json: MiniMax-M2 without its routing bias (use_routing_bias false) is not "
                          "supported; the published checkpoints have one")
    if int(raw.get("shared_intermediate_size") or 0):
        raise ConfigError("config.json: MiniMax-M2 with shared experts (shared_intermediate_size) is not supported; "
                          "the published checkpoints have none")
    layers = int(raw["num_hidden_layers"])
    spec = replace(moe(raw, tuple(range(layers)), scoring="sigmoid", biased=True), norm_topk_prob=True)
    fields = base(raw, qk_norm="full", moe=spec)
    rotary_dim = raw.get("rotary_dim")
    if rotary_dim and "partial_rotary_factor" not in {**raw, **(raw.get("rope_parameters") or {})}:
        fields["rope"] = replace(fields["rope"], partial_rotary_factor=int(rotary_dim) / fields["head_dim"])
    return ModelConfig(**fields)


def _source(cfg: ModelConfig, name: str):
    """The engine's router bias is the MoE block's ``e_score_correction_bias``."""
    m = _BIAS.match(name)
    return (f"{m.group(1)}e_score_correction_bias", lambda t: t) if m else None


FAMILY = Family("minimax_m2", parse, moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"),
                source=_source)
