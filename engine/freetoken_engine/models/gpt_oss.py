"""OpenAI's gpt-oss (``gpt_oss``: gpt-oss-20b, gpt-oss-120b), as published (MXFP4 experts) or
as transformers saves it (bfloat16).

Llama's layers with: attention sinks (``self_attn.sinks``, one logit per query head) and q/k/v/o
biases; sliding-window layers (``layer_types``, 128 tokens) beside full ones; a yarn rotary
whose correction range is not truncated; a router with a bias whose top k logits are softmaxed
(Mixtral's renormalised top k); and experts with biases and a clamped activation:
``h = x W13^T + b13``, gate and up interleaved in h (gate rows 0, 2, 4..., up rows 1, 3, 5...),
``a = (clamp(up, -l, l) + 1) * g * sigmoid(alpha g)`` with ``g = clamp(gate, max=l)``, and
``y = a W2^T + b2`` (``MoeConfig.activation`` "swiglu_oai"). The interleaved rows are read into
the engine's gate-then-up layout (weights and biases alike). The published checkpoints store the
experts in MXFP4 (``*_blocks`` / ``*_scales``), dequantized as read (models/loader.py).
"""
from __future__ import annotations

import re
from typing import Callable

from ..config import ModelConfig
from ..errors import ConfigError
from .hf import Family, base, layer_kinds, moe, windows_by_kind

_ROUTER = re.compile(r"^(.*\.mlp\.)gate\.(weight|bias)$")
_BIASES = re.compile(r"^(.*\.mlp\.)expert_(b13|b2)$")


def parse(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    kinds = layer_kinds("layer_types", kinds, layers, ("full_attention", "sliding_attention"))
    top_k = raw.get("num_experts_per_tok", raw.get("experts_per_token"))
    if top_k is None:
        raise ConfigError("config.json lacks num_experts_per_tok")
    spec = moe(raw | {"norm_topk_prob": True, "num_experts_per_tok": top_k}, tuple(range(layers)),
               router_bias=True, activation="swiglu_oai", expert_bias=True,
               swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)), swiglu_limit=float(raw.get("swiglu_limit", 7.0)))
    bias = bool(raw.get("attention_bias", True))
    return ModelConfig(**base(raw, intermediate_size=0, moe=spec, attn_sinks=True, qkv_bias=bias, o_bias=bias,
                              sliding_window=windows_by_kind(raw, kinds, 128),
                              rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5))))


def _halves(t):
    """Interleaved gate/up rows (last dimension of a bias ``[E, 2I]``) -> gate rows, then up rows."""
    return t.reshape(*t.shape[:-1], -1, 2).transpose(-1, -2).reshape(t.shape)


def _source(cfg: ModelConfig, name: str) -> tuple[str, Callable] | None:
    m = _ROUTER.match(name)
    if m:
        return f"{m.group(1)}router.{m.group(2)}", lambda t: t
    m = _BIASES.match(name)
    if m:
        which = "gate_up_proj_bias" if m.group(2) == "b13" else "down_proj_bias"
        return f"{m.group(1)}experts.{which}", _halves if m.group(2) == "b13" else (lambda t: t)
    return None


FAMILY = Family("gpt_oss", parse, source=_source, fused_transposed=True, interleaved_gate_up=True)
