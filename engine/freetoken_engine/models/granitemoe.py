"""IBM Granite 3.x MoE (``granitemoe``: granite-3.1-1b-a400m, 3b-a800m) and its shared-expert
form (``granitemoeshared``), and the dense Granite 3.x (``granite``); Granite swash
(``granitemoe_swa``: granite-swash-3b-a600m, and its dense ``granite_swa``): the same layers with
sliding-window attention, attention sinks and a rotary base per layer (``_swash``).

Llama's layers with four multipliers (``ModelConfig``): the embeddings scaled, attention scores
scaled by ``attention_multiplier`` instead of head_dim ** -0.5, each branch's output scaled before
the residual add (folded into the weights that end the branch as they are read), the logits
divided by ``logits_scaling``. Routing is softmax over the router's top k logits, which is
Mixtral's renormalised top k. The experts are stored fused: ``block_sparse_moe.input_linear.weight
[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``output_linear.weight [E, H, I]``;
the router is ``block_sparse_moe.router.layer``; the shared expert, ungated, is
``shared_mlp.input_linear [2S, H]`` (gate rows, then up rows) and ``shared_mlp.output_linear``.
The hybrid Granite 4.0 (``granitemoehybrid``: Mamba-2 layers) is ``models/granitemoehybrid.py``,
which reads its MoE and shared MLP through this family's rules.
"""
from __future__ import annotations

import re

import math
from dataclasses import replace

from ..config import ModelConfig, RopeConfig
from ..errors import ConfigError
from .hf import Family, base, layer_kinds, moe, windows_by_kind

_ROUTER = re.compile(r"^(.*\.mlp\.)gate\.weight$")
_SHARED = re.compile(r"^(.*\.)mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight$")


def _multipliers(raw: dict) -> dict:
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: Granite with hidden_act {raw['hidden_act']!r} is not supported (silu only, "
                          "as published)")
    return dict(embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
                # transformers' Granite configs default it to 1.0, not head_dim ** -0.5
                attention_multiplier=float(raw.get("attention_multiplier", 1.0)),
                residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
                logits_scaling=float(raw.get("logits_scaling", 1.0)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))


def parse_dense(raw: dict) -> ModelConfig:
    return ModelConfig(**base(raw, **_multipliers(raw)))


def parse(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    spec = moe(raw | {"norm_topk_prob": True}, tuple(range(layers)),
               shared_intermediate_size=int(raw.get("shared_intermediate_size") or 0))
    return ModelConfig(**base(raw, intermediate_size=0, moe=spec, **_multipliers(raw)))


def _swash(raw: dict) -> dict:
    """Granite swash's attention (``granite_swa``, ``granitemoe_swa``): sliding-window layers (by
    ``layer_types``; by default all but every fourth, from the first), a sink per query head, a
    rotary base per layer (``layer_rope_theta``; 0: no position encoding)."""
    layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types") or ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers)]
    kinds = layer_kinds("layer_types", kinds, layers, ("full_attention", "sliding_attention"))
    thetas = raw.get("layer_rope_theta")
    fields = dict(sliding_window=windows_by_kind(raw, kinds, 128), attn_sinks=True)
    if thetas is not None:
        if not isinstance(thetas, list) or not all(isinstance(t, (int, float)) for t in thetas):
            raise ConfigError(f"config.json: layer_rope_theta must be a list of numbers, got {thetas!r}")
        if len(thetas) != layers or not all(math.isfinite(t) and t >= 0 for t in thetas):
            raise ConfigError(f"config.json: layer_rope_theta must give each of the {layers} layers a rotary base "
                              f">= 0 (0: none), got {thetas}")
        rope = RopeConfig.from_hf(raw)
        fields.update(layer_ropes=tuple(replace(rope, theta=float(t)) if t else rope for t in thetas),
                      nope_layers=tuple(i for i, t in enumerate(thetas) if t == 0))
    return fields


def parse_swash(raw: dict) -> ModelConfig:
    return replace(parse(raw), **_swash(raw))


def parse_swash_dense(raw: dict) -> ModelConfig:
    return replace(parse_dense(raw), **_swash(raw))


def _source(cfg: ModelConfig, name: str):
    """The router is ``router.layer``; the shared expert's gate and up are the halves of
    ``shared_mlp.input_linear``, its down ``shared_mlp.output_linear`` (beside the MoE block, not
    in it)."""
    m = _ROUTER.match(name)
    if m:
        return f"{m.group(1)}router.layer.weight", lambda t: t
    m = _SHARED.match(name)
    if not m:
        return None
    inter = cfg.moe.shared_intermediate_size
    if m.group(2) == "down_proj":
        return f"{m.group(1)}shared_mlp.output_linear.weight", lambda t: t
    half = slice(0, inter) if m.group(2) == "gate_proj" else slice(inter, 2 * inter)
    return f"{m.group(1)}shared_mlp.input_linear.weight", lambda t: _rows(t, half, 2 * inter)


def _source_swash(cfg: ModelConfig, name: str):
    """Granite swash is published in transformers 5's names: the router ``router.weight``, the
    experts stacked (``experts.gate_up_proj`` / ``down_proj``); the shared MLP as Granite 3.x's."""
    m = _ROUTER.match(name)
    return (f"{m.group(1)}router.weight", lambda t: t) if m else _source(cfg, name)


def _rows(t, half: slice, rows: int):
    if t.dim() != 2 or t.shape[0] != rows:
        raise ConfigError(f"shared_mlp.input_linear.weight has shape {tuple(t.shape)}: expected "
                          f"[2 x shared_intermediate_size = {rows}, hidden]")
    return t[half]


_MOE = dict(parse=parse, moe_prefix="block_sparse_moe", source=_source,
            fused_names=("input_linear.weight", "output_linear.weight"))
FAMILIES = (Family("granitemoe", **_MOE), Family("granitemoeshared", **_MOE), Family("granite", parse_dense),
            Family("granitemoe_swa", parse_swash, moe_prefix="block_sparse_moe", source=_source_swash),
            Family("granite_swa", parse_swash_dense))
