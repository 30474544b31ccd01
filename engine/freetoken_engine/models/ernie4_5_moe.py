"""ERNIE-4.5-MoE (``ernie4_5_moe``: ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B): llama-style attention
whose rotary turns interleaved pairs of each head (dimensions 2j, 2j+1), dense MLPs outside
``moe_layer_start_index``..``moe_layer_end_index`` (every ``moe_layer_interval``), then routed
experts chosen by softmax score plus a correction bias (``mlp.moe_statics``), weighted by
score over ``max(sum, moe_norm_min)``, beside ``moe_num_shared_experts`` ungated shared experts.

The engine's rotary turns the two halves of a head. Reordering the rows of q_proj and k_proj
(and their biases) within each head, ``[0, 2, 4, ...; 1, 3, 5, ...]``, turns the interleaved
rotary into that one: attention scores are sums over a head's dimensions, the same in any
order that q and k share, and v is untouched. So the checkpoint is reordered as it is read.

The multi-token-prediction tensors some checkpoints carry (``model.mtp_*``) are left unread, as
transformers leaves them, and out of a packed folder.

ERNIE-4.5-VL (``ernie4_5_vl_moe``: ERNIE-4.5-VL-28B-A3B and -424B-A47B, -Thinking) is served as
text: its language model is this one, with each MoE layer's experts in two sets, text then
vision (``mlp.experts.0..E-1`` then ``E..2E-1``, their sizes ``moe_intermediate_size[0]`` and
``[1]``), a router per set (``gate.weight`` for text, stored ``[hidden, experts]``;
``gate.weight_1`` for vision) and a correction bias per set (``moe_statics`` rows 0 and 1). A
text token meets the text set only; its 3-D rotary, with the three positions of a text token
equal, is this rotary. The vision tower, its resampler and the vision experts are left unread.
"""
from __future__ import annotations

import re

from ..config import ModelConfig
from ..errors import ConfigError
from .hf import Family, base, interleaved_rotary, language_model, layer_kinds, moe, need, shared_experts

_BIAS = re.compile(r"^(.*\.mlp\.)gate\.e_score_correction_bias$")
_MTP = re.compile(r"(^|\.)mtp")


def parse(raw: dict, sparse: tuple[int, ...] | None = None) -> ModelConfig:
    """``sparse``: the MoE layers where the config names them otherwise (ERNIE-4.5-VL's
    ``mlp_layer_types``); else ``moe_layer_start_index``..``end_index`` every ``interval``."""
    if raw.get("use_bias"):
        raise ConfigError("config.json: ERNIE-4.5 with use_bias (biases on every projection and the LM head) "
                          "is not supported; the published ERNIE-4.5 MoE checkpoints have none")
    layers = int(need(raw, "num_hidden_layers"))
    if sparse is None:
        start = int(raw.get("moe_layer_start_index", 1))
        end = int(raw.get("moe_layer_end_index", -1))
        end = layers - 1 if end == -1 else end
        every = int(raw.get("moe_layer_interval", 1) or 1)
        sparse = tuple(i for i in range(layers) if (i + 1) % every == 0 and start <= i <= end)
    experts = need(raw, "moe_num_experts", "num_experts")
    spec = moe(raw | {"num_experts": experts, "num_experts_per_tok": need(raw, "moe_k", "num_experts_per_tok"),
                      "norm_topk_prob": True},
               sparse, biased=True, norm_floor=float(raw.get("moe_norm_min", 1e-12)),
               shared_intermediate_size=int(need(raw, "moe_intermediate_size"))
               * int(raw.get("moe_num_shared_experts", 0) or 0))
    return ModelConfig(**base(raw, tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)), moe=spec))


def _source(cfg: ModelConfig, name: str):
    rows = interleaved_rotary(cfg, name)
    if rows:
        return rows
    m = _BIAS.match(name)
    if m:
        return f"{m.group(1)}moe_statics.e_score_correction_bias", lambda t: t.reshape(-1)
    return shared_experts(name)


def skip(cfg: ModelConfig, key: str) -> bool:
    return _MTP.search(key) is not None


FAMILY = Family("ernie4_5_moe", parse, source=_source, skip=skip)

_ROUTER = re.compile(r"^(.*\.mlp\.)gate\.weight$")
_VISION = re.compile(r"^(model\.)?(vision_model|resampler_model)\.|\.mlp\.gate\.weight_1$")


def parse_vl(raw: dict) -> ModelConfig:
    """The language model's config; of the per-set lists (text, vision) the text set's entry."""
    text = language_model(raw, "ernie4_5_vl_moe")
    text |= {k: text[k][0] for k in ("moe_num_experts", "moe_intermediate_size") if isinstance(text.get(k), list)}
    kinds = text.get("mlp_layer_types")
    if not kinds:
        return parse(text)
    kinds = layer_kinds("mlp_layer_types", kinds, int(need(text, "num_hidden_layers")), ("dense", "sparse"))
    return parse(text, tuple(i for i, k in enumerate(kinds) if k == "sparse"))


def _source_vl(cfg: ModelConfig, name: str):
    """The text router stored transposed; the text row of the two-row correction bias."""
    m = _ROUTER.match(name)
    if m:
        return name, lambda t: t.t() if t.dim() == 2 and t.shape[0] == cfg.hidden_size else t
    m = _BIAS.match(name)
    if m:
        return f"{m.group(1)}moe_statics.e_score_correction_bias", lambda t: t[0] if t.dim() == 2 else t.reshape(-1)
    return _source(cfg, name)


def skip_vl(cfg: ModelConfig, key: str) -> bool:
    """MTP tensors, the vision tower and resampler, the vision router and experts."""
    if skip(cfg, key) or _VISION.search(key):
        return True
    m = re.search(r"\.mlp\.experts\.(\d+)\.", key)
    return bool(m) and cfg.moe is not None and int(m.group(1)) >= cfg.moe.num_experts


VL = Family("ernie4_5_vl_moe", parse_vl, source=_source_vl, skip=skip_vl)
