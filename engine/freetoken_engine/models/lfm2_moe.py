"""Liquid AI's LFM2-MoE (``lfm2_moe``: LFM2-8B-A1B), a hybrid for devices.

Most layers mix tokens by a gated short convolution (``layer_types`` "conv"; ``layers/shortconv.py``:
its state is its last ``conv_L_cache - 1`` inputs), the others by attention with per-head q/k
RMSNorm (``q_layernorm``, ``k_layernorm``; output ``out_proj``). Each layer's mixer and MLP are
normed first (``operator_norm``, ``ffn_norm``), the model's output by ``embedding_norm``. The
first ``num_dense_layers`` MLPs are dense (``feed_forward.w1/w3/w2``), the rest route: sigmoid
scores, a per-expert bias that steers the choice (``feed_forward.expert_bias``), the top k
renormalised, times ``routed_scaling_factor``; experts ``feed_forward.experts.{e}.w1/w3/w2``.
LFM2 renormalises over the sum plus 1e-6, the engine over the sum: weights apart by 1e-6 of
themselves. Its recurrent state is checkpointed at anchors as the other hybrids' is
(``--state-checkpoints``).
"""
from __future__ import annotations

import re

from ..config import LinearAttnConfig, ModelConfig
from ..errors import ConfigError
from .hf import Family, base, layer_kinds, moe, need

_RENAMES = ((re.compile(r"^(.*\.)linear_attn\.(.*)$"), r"\1conv.\2"),
            (re.compile(r"^(.*\.)input_layernorm\.weight$"), r"\1operator_norm.weight"),
            (re.compile(r"^(.*\.)post_attention_layernorm\.weight$"), r"\1ffn_norm.weight"),
            (re.compile(r"^(.*\.self_attn\.)o_proj\.weight$"), r"\1out_proj.weight"),
            (re.compile(r"^(.*\.self_attn\.)([qk])_norm\.weight$"), r"\1\2_layernorm.weight"),
            (re.compile(r"^(.*\.mlp\.)gate_proj\.weight$"), r"\1w1.weight"),
            (re.compile(r"^(.*\.mlp\.)up_proj\.weight$"), r"\1w3.weight"),
            (re.compile(r"^(.*\.mlp\.)down_proj\.weight$"), r"\1w2.weight"),
            (re.compile(r"^(.*\.mlp\.)gate\.e_score_correction_bias$"), r"\1expert_bias"),
            (re.compile(r"^model\.norm\.weight$"), "model.embedding_norm.weight"))


def _kinds(raw: dict, layers: int) -> list[str]:
    kinds = raw.get("layer_types")
    if kinds is None and raw.get("full_attn_idxs") is not None:       # the first LFM2 configs' form
        kinds = ["full_attention" if i in raw["full_attn_idxs"] else "conv" for i in range(layers)]
    return layer_kinds("layer_types", kinds, layers, ("conv", "full_attention"))


def parse(raw: dict) -> ModelConfig:
    if raw.get("use_expert_bias") is False:
        raise ConfigError("config.json: LFM2-MoE without its expert bias (use_expert_bias false) is not supported; "
                          "the published checkpoints have one")
    layers = int(need(raw, "num_hidden_layers"))
    kinds = _kinds(raw, layers)
    hidden = int(need(raw, "hidden_size"))
    dense = int(raw.get("num_dense_layers", 2) or 0)
    spec = moe(raw | {"norm_topk_prob": raw.get("norm_topk_prob", True)}, tuple(range(min(dense, layers), layers)),
               scoring="sigmoid", biased=True, routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))
    tied = raw.get("tie_word_embeddings", raw.get("tie_embedding", True))
    return ModelConfig(**base(
        raw, qk_norm="head", rms_norm_eps=float(raw.get("norm_eps", 1e-5)), tie_word_embeddings=bool(tied), moe=spec,
        linear_layers=tuple(i for i, k in enumerate(kinds) if k == "conv"),
        linear=LinearAttnConfig.short_conv(hidden, int(raw.get("conv_L_cache", 3)), bool(raw.get("conv_bias")))))


def _source(cfg: ModelConfig, name: str):
    for pattern, replacement in _RENAMES:
        if pattern.match(name):
            return pattern.sub(replacement, name), lambda t: t
    return None


FAMILY = Family("lfm2_moe", parse, moe_prefix="feed_forward", expert_names=("w1", "w3", "w2"), source=_source)
