"""LG's EXAONE MoE (``exaone_moe``: K-EXAONE-236B-A23B), and Tencent's HY-V3 (``hy_v3``: its MoE
block behind Llama's attention, ``parse_hy_v3``).

Attention with per-head q/k RMSNorm; with a ``sliding_window``, the ``sliding_attention`` layers
(``layer_types``, else three of every ``sliding_window_pattern``) attend within the window with
the rotary, and the others attend globally with no position encoding at all (``nope_layers``).
Dense MLPs where ``mlp_layer_types`` says ``dense`` (else the first ``first_k_dense_replace``),
elsewhere DeepSeek-V3's routing (``layers/moe.BiasedRouter``: sigmoid scores, the correction bias
stored on the MoE block as ``mlp.e_score_correction_bias``, group-limited top k, renormalised,
times ``routed_scaling_factor``) plus ``num_shared_experts`` ungated shared experts
(``mlp.shared_experts``).
"""
from __future__ import annotations

import re

from ..config import ModelConfig
from .glm4_moe import skip
from .hf import Family, base, layer_kinds, moe, need, shared_experts

_BIAS = re.compile(r"^(.*\.mlp\.)gate\.e_score_correction_bias$")


def _types(raw: dict, layers: int) -> tuple[list[str], list[str]]:
    """(attention, MLP) type of each layer, as transformers fills them in."""
    mlp = raw.get("mlp_layer_types") or ["dense" if i < int(raw.get("first_k_dense_replace", 1) or 0) else "sparse"
                                         for i in range(layers)]
    attn = raw.get("layer_types")
    if not attn:
        pattern = int(raw.get("sliding_window_pattern") or 0) if raw.get("sliding_window") else 0
        attn = ["sliding_attention" if pattern and (i + 1) % pattern else "full_attention" for i in range(layers)]
    return (layer_kinds("layer_types", attn, layers, ("sliding_attention", "full_attention")),
            layer_kinds("mlp_layer_types", mlp, layers, ("dense", "sparse")))


def parse(raw: dict) -> ModelConfig:
    layers = int(need(raw, "num_hidden_layers"))
    attn, mlp = _types(raw, layers)
    window = raw.get("sliding_window")
    inter = int(need(raw, "moe_intermediate_size"))
    spec = moe(raw | {"norm_topk_prob": raw.get("norm_topk_prob", True)},
               tuple(i for i, kind in enumerate(mlp) if kind == "sparse"), scoring="sigmoid", biased=True,
               n_group=int(raw.get("n_group", 1) or 1), topk_group=int(raw.get("topk_group", 1) or 1),
               routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
               shared_intermediate_size=inter * int(raw.get("num_shared_experts", 1) or 0))
    return ModelConfig(**base(
        raw, qk_norm="head", moe=spec,
        sliding_window=tuple(window if kind == "sliding_attention" else None for kind in attn) if window else (),
        nope_layers=tuple(i for i, kind in enumerate(attn) if kind == "full_attention") if window else ()))


def _source(cfg: ModelConfig, name: str):
    """The router's bias is the MoE block's; the shared experts are ``mlp.shared_experts``."""
    m = _BIAS.match(name)
    return (f"{m.group(1)}e_score_correction_bias", lambda t: t) if m else shared_experts(name)


def parse_hy_v3(raw: dict) -> ModelConfig:
    """Tencent's HY-V3 (``hy_v3``): the same MoE block (its correction bias on the block, sigmoid
    scores renormalised times ``router_scaling_factor``, ``num_shared_experts`` shared experts,
    dense layers where ``mlp_layer_types`` says so: by default the first) behind Llama's attention
    with per-head q/k norms before the rotary; no sliding windows."""
    layers = int(need(raw, "num_hidden_layers"))
    mlp = layer_kinds("mlp_layer_types", raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1), layers,
                      ("dense", "sparse"))
    inter = int(need(raw, "moe_intermediate_size"))
    spec = moe(raw | {"norm_topk_prob": True}, tuple(i for i, kind in enumerate(mlp) if kind == "sparse"),
               scoring="sigmoid", biased=True, routed_scaling_factor=float(raw.get("router_scaling_factor", 2.826)),
               shared_intermediate_size=inter * int(raw.get("num_shared_experts", 1) or 0))
    return ModelConfig(**base(raw, qk_norm="head", moe=spec))


_HY = re.compile(r"^(.*\.mlp\.)(gate\.weight|gate\.e_score_correction_bias|shared_expert\.(.*))$")


def _source_hy_v3(cfg: ModelConfig, name: str):
    """HY-V3's published names: the router ``mlp.router.gate``, the correction bias
    ``mlp.expert_bias``, the shared experts ``mlp.shared_mlp``."""
    m = _HY.match(name)
    if m is None:
        return None
    part = m.group(2)
    source = ("router.gate.weight" if part == "gate.weight" else "expert_bias" if part.startswith("gate.")
              else f"shared_mlp.{m.group(3)}")
    return m.group(1) + source, lambda t: t


FAMILY = Family("exaone_moe", parse, source=_source, skip=skip)
HY_V3 = Family("hy_v3", parse_hy_v3, source=_source_hy_v3, skip=skip)
