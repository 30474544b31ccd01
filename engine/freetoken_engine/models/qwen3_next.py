"""Hybrid MoE families: Qwen3-Next (``qwen3_next``) and Qwen3.5/3.6-MoE (``qwen3_5_moe_text``, and
``qwen3_5_moe``: the multimodal checkpoint, whose language model the engine runs and whose
vision tower it leaves unread).

Three of every four layers (``layer_types``, or ``full_attention_interval``) mix tokens by Gated
DeltaNet (``layers/deltanet.py``), the others by attention whose output a per-head gate from
``q_proj`` scales, over a partial rotary embedding. Every MLP is routed experts plus a
sigmoid-gated shared expert. Their RMSNorms scale by ``1 + weight`` (the gated one inside Gated
DeltaNet by ``weight``): the engine's norms take ``1 + weight``, computed in float32 when loaded.
Qwen3-Next's input projections are grouped per key head (``in_proj_qkvz``, ``in_proj_ba``) and
are reordered into Qwen3.5's layout (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch

from ..config import LinearAttnConfig, ModelConfig
from ..errors import ConfigError
from .hf import Family, base, moe, need, sparse_layers

_OFFSET_NORM = re.compile(r"(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm)\.weight$|^model\.norm\.weight$"
                          r"|^mtp\.(norm|pre_fc_norm_hidden|pre_fc_norm_embedding)\.weight$")
_NEXT_PROJ = re.compile(r"^(.*\.linear_attn\.)in_proj_(qkv|z|b|a)\.weight$")


def parse(raw: dict) -> ModelConfig:
    if raw.get("model_type") == "qwen3_5_moe":           # the multimodal checkpoint: its text model
        text = dict(raw.get("text_config") or {})
        if not text:
            raise ConfigError("config.json of a qwen3_5_moe model lacks text_config")
        text.setdefault("eos_token_id", raw.get("eos_token_id"))
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        raw = dict(text, model_type="qwen3_5_moe")
    layers = int(need(raw, "num_hidden_layers"))
    types = raw.get("layer_types")
    if not types:
        every = int(raw.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"full_attention", "linear_attention"}:
        raise ConfigError(f"config.json: layer_types must name {layers} layers, each full_attention or linear_attention")
    lin = LinearAttnConfig(k_heads=int(need(raw, "linear_num_key_heads")), v_heads=int(need(raw, "linear_num_value_heads")),
                           k_dim=int(need(raw, "linear_key_head_dim")), v_dim=int(need(raw, "linear_value_head_dim")),
                           conv=int(need(raw, "linear_conv_kernel_dim")))
    fields = base(raw, qk_norm="head", attn_gate=True, linear=lin,
                  linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                  moe=moe(raw, sparse_layers(raw, layers),
                          shared_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
                          shared_gate=True))
    fields["mtp_layers"] = int(raw.get("num_nextn_predict_layers") or raw.get("mtp_num_hidden_layers") or 0)
    if raw["model_type"] != "qwen3_next":     # Qwen3.5's router always renormalises its top k
        fields["moe"] = replace(fields["moe"], norm_topk_prob=True)
    rope = fields["rope"]
    if "partial_rotary_factor" not in {**raw, **(raw.get("rope_parameters") or {})}:
        fields["rope"] = replace(rope, partial_rotary_factor=0.25)     # the families' default
    return ModelConfig(**fields)


def _plus_one(t):
    return t.float() + 1.0


def _offset_norms(cfg: ModelConfig, name: str):
    return (name, _plus_one) if _OFFSET_NORM.search(name) else None


def _next_source(cfg: ModelConfig, name: str):
    """Qwen3-Next's grouped projections, cut into Qwen3.5's four."""
    m = _NEXT_PROJ.match(name)
    if m is None:
        return _offset_norms(cfg, name)
    lin = cfg.linear
    r = lin.v_heads // lin.k_heads
    part = m.group(2)
    if part in ("qkv", "z"):
        sizes = [lin.k_dim, lin.k_dim, r * lin.v_dim, r * lin.v_dim]

        def cut(t):
            q, k, v, z = t.view(lin.k_heads, sum(sizes), -1).split(sizes, 1)
            if part == "z":
                return z.reshape(-1, t.shape[-1])
            return torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)])
        return m.group(1) + "in_proj_qkvz.weight", cut

    def cut_ba(t):
        b, a = t.view(lin.k_heads, 2 * r, -1).split([r, r], 1)
        return (b if part == "b" else a).reshape(-1, t.shape[-1])
    return m.group(1) + "in_proj_ba.weight", cut_ba


QWEN3_NEXT = Family("qwen3_next", parse, source=_next_source)
QWEN3_5_TEXT = Family("qwen3_5_moe_text", parse, source=_offset_norms)
QWEN3_5 = Family("qwen3_5_moe", parse, model_prefix="model.language_model", source=_offset_norms)
FAMILIES = (QWEN3_NEXT, QWEN3_5_TEXT, QWEN3_5)
