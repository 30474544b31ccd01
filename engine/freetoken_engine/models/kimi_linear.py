"""Kimi-Linear (``kimi_linear``: Kimi-Linear-48B-A3B-Base / -Instruct): a hybrid whose layers mix
tokens by Kimi Delta Attention (``layers/kda.py``; three of every four) or by multi-head latent
attention without any position encoding (DeepSeek's, ``layers/mla.py``, the rotary's part of the
keys left unrotated), and whose MLPs are DeepSeek-V3's MoE (sigmoid scores, a correction bias,
group-limited top k, renormalised, times ``routed_scaling_factor``; shared experts) after dense
first layers. Moonshot's tiktoken tokenizer (``models/tiktoken_tokenizer.py``).

The published config names the layers in ``linear_attn_config`` (``kda_layers`` and
``full_attn_layers``, counted from one; transformers writes ``layer_types``), and the MoE in its
own words (``num_experts``, ``num_experts_per_token``, ``moe_renormalize``, ``num_expert_group``,
``num_shared_experts``). Both attention kinds are ``self_attn`` in the checkpoint; the experts
are ``block_sparse_moe.experts.{e}.w1/w2/w3``.
"""
from __future__ import annotations

import re
from dataclasses import replace

from ..config import LinearAttnConfig, ModelConfig
from ..errors import ConfigError
from . import deepseek, glm4_moe
from .hf import Family, layer_kinds, need

_RENAMED = {"num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
            "moe_renormalize": "norm_topk_prob", "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts",
            "model_max_length": "max_position_embeddings"}
_MIXER = re.compile(r"^(.*\.)linear_attn\.(.*)$")


def _layer_types(raw: dict, layers: int) -> list[str]:
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    spec = raw.get("linear_attn_config") or {}
    if "kda_layers" in spec and "full_attn_layers" in spec:
        kinds: list = [None] * layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for n in spec[key]:
                if not 1 <= int(n) <= layers:
                    raise ConfigError(f"config.json: linear_attn_config.{key} names layer {n} of {layers} "
                                      "(counted from 1)")
                kinds[int(n) - 1] = kind
        return kinds
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]


def parse(raw: dict) -> ModelConfig:
    if raw.get("mla_use_nope") is False:
        raise ConfigError("config.json: Kimi-Linear with mla_use_nope false (a rotary on the latent attention) is "
                          "not supported; the published checkpoints use none")
    raw = {_RENAMED.get(k, k): v for k, v in raw.items()}
    layers = int(need(raw, "num_hidden_layers"))
    kinds = layer_kinds("layer_types", _layer_types(raw, layers), layers, ("linear_attention", "full_attention"))
    spec = raw.get("linear_attn_config") or {}
    heads = int(spec.get("num_heads", raw.get("linear_num_heads", 32)))
    dim = int(spec.get("head_dim", raw.get("linear_head_dim", 128)))
    conv = int(spec.get("short_conv_kernel_size", raw.get("linear_conv_kernel_dim", 4)))
    cfg = deepseek.parse_v3(raw | {"first_k_dense_replace": 0, "num_nextn_predict_layers": 0})
    attention = tuple(i for i, k in enumerate(kinds) if k == "full_attention")
    return replace(cfg, moe=replace(cfg.moe, layers=glm4_moe.routed_by_kinds(raw).layers),
                   linear=LinearAttnConfig(k_heads=heads, v_heads=heads, k_dim=dim, v_dim=dim, conv=conv, kind="kda"),
                   linear_layers=tuple(i for i, k in enumerate(kinds) if k == "linear_attention"),
                   nope_layers=attention)


def _source(cfg: ModelConfig, name: str):
    """Kimi Delta Attention's tensors are the layer's ``self_attn.*`` (``A_log`` stored ``[1, 1, h, 1]``);
    the shared experts are ``shared_experts``."""
    m = _MIXER.match(name)
    if m:
        return f"{m.group(1)}self_attn.{m.group(2)}", (lambda t: t.reshape(-1)) if name.endswith(".A_log") else \
            (lambda t: t)
    return glm4_moe._source(cfg, name)


FAMILY = Family("kimi_linear", parse, moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"), source=_source)
