"""Tencent's Hunyuan MoE (``hunyuan_v1_moe``: Hunyuan-A13B).

Llama's attention with per-head q/k RMSNorm (``query_layernorm``, ``key_layernorm``) applied
after the rotary, not before it (``qk_norm="rotated"``: in a decode step both run just before the
fused attention, which then rotates by the identity); the rotary's NTK-alpha form (``rope_scaling`` type ``dynamic`` with an ``alpha``: fixed
frequencies over the base ``rope_theta * alpha ** (d / (d - 2))``). Every layer routes: softmax
over a router in ``mlp.gate.wg``, the top k renormalised, beside an ungated shared MLP
(``mlp.shared_mlp``, ``intermediate_size`` times ``num_shared_expert``). The published config
gives per-layer lists (``num_experts``, ``moe_topk``, ``moe_intermediate_size``,
``num_shared_expert``), read when every layer's value is the same; cross-layer attention
(``use_cla``) is refused.
"""
from __future__ import annotations

import re

from ..config import ModelConfig
from ..errors import ConfigError
from .hf import Family, base, moe, need

_RENAMES = ((re.compile(r"^(.*\.mlp\.)gate\.weight$"), r"\1gate.wg.weight"),
            (re.compile(r"^(.*\.self_attn\.)q_norm\.weight$"), r"\1query_layernorm.weight"),
            (re.compile(r"^(.*\.self_attn\.)k_norm\.weight$"), r"\1key_layernorm.weight"),
            (re.compile(r"^(.*\.mlp\.)shared_expert\.(.*)$"), r"\1shared_mlp.\2"))


def _one(raw: dict, name: str, default=None):
    """A per-layer field's one value (a list whose values all agree, or a number)."""
    value = raw.get(name, default)
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ConfigError(f"config.json: {name} differs between layers ({value}); the engine runs one value "
                              "for every layer")
        value = value[0]
    return value


def _rope(raw: dict, head_dim: int) -> dict:
    """``raw`` with an NTK-alpha rotary as the plain rotary over its stretched base."""
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind != "dynamic":
        return raw
    if not params.get("alpha"):
        raise ConfigError("config.json: Hunyuan's dynamic rotary without an alpha (dynamic NTK scaling by "
                          "sequence length) is not supported; the published checkpoints give a fixed alpha")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    stretched = theta * float(params["alpha"]) ** (head_dim / (head_dim - 2))
    return {k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_parameters", "rope_theta")} | {
        "rope_parameters": {"rope_type": "default", "rope_theta": stretched}}


def parse(raw: dict) -> ModelConfig:
    if raw.get("use_cla"):
        raise ConfigError("config.json: Hunyuan with cross-layer attention (use_cla) is not supported; "
                          "Hunyuan-A13B has none")
    layers = int(need(raw, "num_hidden_layers"))
    heads = int(need(raw, "num_attention_heads"))
    head_dim = int(raw.get("head_dim") or int(need(raw, "hidden_size")) // heads)
    inter = int(need(raw, "intermediate_size"))
    spec = moe({"num_experts": _one(raw, "num_experts"), "num_experts_per_tok": _one(raw, "moe_topk"),
                "moe_intermediate_size": _one(raw, "moe_intermediate_size", inter), "norm_topk_prob": True},
               tuple(range(layers)), shared_intermediate_size=inter * int(_one(raw, "num_shared_expert", 1) or 1))
    qk_norm = "rotated" if raw.get("use_qk_norm", True) else "none"
    return ModelConfig(**base(_rope(raw, head_dim), qk_norm=qk_norm, o_bias=False, intermediate_size=0, moe=spec))


def _source(cfg: ModelConfig, name: str):
    for pattern, replacement in _RENAMES:
        if pattern.match(name):
            return pattern.sub(replacement, name), lambda t: t
    return None


FAMILY = Family("hunyuan_v1_moe", parse, source=_source)
