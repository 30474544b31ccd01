"""Arcee's AFMoE (``afmoe``: Trinity Nano 6B-A1B, Trinity Mini 26B-A3B).

Attention with per-head q/k RMSNorm, its output gated by the sigmoid of a projection of its own
(``self_attn.gate_proj``); sliding-window layers with the rotary beside global layers
(``layer_types``, else one in every ``global_attn_every_n_layers``) with no position encoding.
Each branch's output is normed before the residual add (``post_attention_layernorm``,
``post_mlp_layernorm``; ``pre_mlp_layernorm`` before the MLP). Dense MLPs in the first
``num_dense_layers``, then sigmoid routing with a per-expert bias that steers the choice
(``mlp.expert_bias``; router ``mlp.router.gate``), renormalised, times ``route_scale``, beside
``num_shared_experts`` ungated shared experts. With ``mup_enabled`` the embeddings are scaled by
the square root of the hidden size.
"""
from __future__ import annotations

import math
import re

from ..config import ModelConfig
from .hf import Family, base, layer_kinds, moe, need, shared_experts

_ROUTER = re.compile(r"^(.*\.mlp\.)gate\.(weight|e_score_correction_bias)$")


def parse(raw: dict) -> ModelConfig:
    layers = int(need(raw, "num_hidden_layers"))
    every = int(raw.get("global_attn_every_n_layers") or 4)
    kinds = layer_kinds("layer_types", raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)], layers,
        ("sliding_attention", "full_attention"))
    window = raw.get("sliding_window")
    dense = int(raw.get("num_dense_layers", 1) or 0)
    spec = moe(raw | {"norm_topk_prob": True}, tuple(range(min(dense, layers), layers)), scoring="sigmoid",
               biased=True, routed_scaling_factor=float(raw.get("route_scale", 1.0) or 1.0),
               shared_intermediate_size=int(need(raw, "moe_intermediate_size"))
               * int(raw.get("num_shared_experts", 2) or 0))
    hidden = int(need(raw, "hidden_size"))
    return ModelConfig(**base(
        raw, qk_norm="head", o_bias=bool(raw.get("attention_bias", False)), moe=spec, gate_proj=True,
        sandwich_norms=True,
        sliding_window=tuple(window if k == "sliding_attention" else None for k in kinds) if window else (),
        nope_layers=tuple(i for i, k in enumerate(kinds) if k == "full_attention"),
        embedding_multiplier=math.sqrt(hidden) if raw.get("mup_enabled") else 1.0))


def _source(cfg: ModelConfig, name: str):
    """The router is ``mlp.router.gate``, its bias the MoE block's ``expert_bias``; the shared
    experts are ``mlp.shared_experts``."""
    m = _ROUTER.match(name)
    if m:
        return (f"{m.group(1)}router.gate.weight" if m.group(2) == "weight" else f"{m.group(1)}expert_bias"), \
            lambda t: t
    return shared_experts(name)


FAMILY = Family("afmoe", parse, source=_source)
