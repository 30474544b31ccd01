"""Families routed as DeepSeek-V3 routes, on standard attention.

GLM-4.5 / GLM-4.5-Air / GLM-4.6 / GLM-4.7 (``glm4_moe``): llama-style attention with q/k/v
biases (``attention_bias``; ``o_proj`` has none), optional per-head q/k RMSNorm
(``use_qk_norm``) and rotary over the first half of each head (``partial_rotary_factor`` 0.5);
dense MLPs in the first ``first_k_dense_replace`` layers, then routed experts with sigmoid
scoring (``layers/moe.BiasedRouter``: a float32 router, an ``e_score_correction_bias`` that
steers the choice, group-limited top k, weights times ``routed_scaling_factor``) plus
``n_shared_experts`` ungated shared experts (``mlp.shared_experts``).

The checkpoints ship a multi-token-prediction layer after their own (``model.layers.{N}``,
``num_nextn_predict_layers``), DeepSeek-V3's kind: ``enorm`` and ``hnorm`` norm the next token's
embedding and the model's final hidden state, ``eh_proj`` joins them, a full decoder layer
follows and ``shared_head.norm`` norms its output for the LM head (the layer's own copies of the
embedding and head are the model's). It maps onto the engine's MTP head (``--speculative-method
mtp``), with the embedding at position 0 zeroed as vLLM does; transformers does not run it.

dots.llm1 (``dots1``): the same routing and shared experts (``norm_topk_prob`` off unless set,
no dense layer unless ``first_k_dense_replace``), with q/k RMSNorm per head always, the
attention's biases on ``o_proj`` too, full rotary, and sliding-window layers (``layer_types``).

Solar Open (``solar_open``, Upstage's Solar Open 100B): GLM's routing and shared experts in
every layer, full rotary, no q/k norm, q/k/v biases only with ``attention_bias``.
"""
from __future__ import annotations

import re
from dataclasses import replace

from ..config import ModelConfig
from .hf import Family, base, layer_kinds, moe, need, shared_experts, sliding

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _routed(raw: dict, first_dense: int, norm_topk_prob: bool):
    """The routed and shared experts, as transformers' defaults for the family fill them in."""
    layers = int(need(raw, "num_hidden_layers"))
    dense = int(raw.get("first_k_dense_replace", first_dense) or 0)
    inter = int(need(raw, "moe_intermediate_size"))
    return moe(raw | {"num_experts": need(raw, "n_routed_experts", "num_local_experts", "num_experts"),
                      "norm_topk_prob": raw.get("norm_topk_prob", norm_topk_prob)},
               tuple(range(min(dense, layers), layers)), scoring="sigmoid", biased=True,
               n_group=int(raw.get("n_group", 1) or 1), topk_group=int(raw.get("topk_group", 1) or 1),
               routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
               shared_intermediate_size=inter * int(raw.get("n_shared_experts", 1) or 0))


def routed_by_kinds(raw: dict, first_k: bool = True):
    """``_routed`` in the layers ``mlp_layer_types`` names "sparse": by default all after the first
    ``first_k_dense_replace`` (itself 1 by default; MiniCPM5's, Kimi-Linear's), or after the first
    alone (``first_k`` False: GLM-4.7-Flash's, as transformers reads its config)."""
    layers = int(need(raw, "num_hidden_layers"))
    dense = int(raw.get("first_k_dense_replace", 1) or 0) if first_k else 1
    kinds = raw.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(layers)]
    kinds = layer_kinds("mlp_layer_types", kinds, layers, ("dense", "sparse"))
    routed = _routed(raw, first_dense=0, norm_topk_prob=True)
    return replace(routed, layers=tuple(i for i, k in enumerate(kinds) if k == "sparse"))


def parse(raw: dict) -> ModelConfig:
    fields = base(raw, o_bias=False, qk_norm="head" if raw.get("use_qk_norm") else "none",
                  moe=_routed(raw, first_dense=1, norm_topk_prob=True),
                  mtp_layers=int(raw.get("num_nextn_predict_layers") or 0), mtp_zero_first=True)
    if "partial_rotary_factor" not in {**raw, **(raw.get("rope_parameters") or {})}:
        fields["rope"] = replace(fields["rope"], partial_rotary_factor=0.5)
    return ModelConfig(**fields)


_MTP_PARTS = {"pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "fc": "eh_proj",
              "norm": "shared_head.norm"}


def _mtp_layer(cfg: ModelConfig) -> str:
    return f"model.layers.{cfg.num_layers}"


def _source(cfg: ModelConfig, name: str):
    """The engine's ``shared_expert`` is the checkpoint's ``shared_experts``; its MTP head
    (``mtp.*``) is the layer after the model's own."""
    if name.startswith("mtp."):
        part, _, rest = name[len("mtp."):].partition(".")
        stem = _mtp_layer(cfg)
        if part == "layers":                                  # mtp.layers.0.<the decoder layer's own>
            inner = f"{stem}.{rest.partition('.')[2]}"
            return shared_experts(inner) or (inner, lambda t: t)
        return f"{stem}.{_MTP_PARTS[part]}.{rest}", lambda t: t
    return shared_experts(name)


def skip(cfg: ModelConfig, key: str) -> bool:
    """A second MTP layer (``model.layers.{n}`` past the first after the model's own): unread."""
    m = _LAYER.match(key)
    return m is not None and int(m.group(1)) > cfg.num_layers


def parse_dots1(raw: dict) -> ModelConfig:
    layers = int(need(raw, "num_hidden_layers"))
    return ModelConfig(**base(raw, qk_norm="head", sliding_window=sliding(raw, layers, True),
                              moe=_routed(raw, first_dense=0, norm_topk_prob=False)))


def parse_solar_open(raw: dict) -> ModelConfig:
    return ModelConfig(**base(raw, o_bias=False, moe=_routed(raw, first_dense=0, norm_topk_prob=True)))


FAMILY = Family("glm4_moe", parse, source=_source, skip=skip, mtp_layer=_mtp_layer)
DOTS1 = Family("dots1", parse_dots1, source=_source)
SOLAR_OPEN = Family("solar_open", parse_solar_open, source=_source, skip=skip)
