"""Kolibri (``kolibri1``): EXAONE 4's attention (per-head q/k norms; with a ``sliding_window``,
the ``sliding_attention`` layers attend within it with the rotary and the others globally with no
position encoding), four norms a layer as GLM-4's (the attention's output normed before its
residual add, the MLP's input and output normed), and a MoE block in every layer: the router's float32
logits plus a correction bias choose the top k, their sigmoids are the weights (renormalised with
``norm_topk_prob``), and a shared expert is added."""
from __future__ import annotations

import re

from ..config import ModelConfig
from .hf import Family, base, layer_kinds, moe, shared_experts, windows_by_kind

# the published names of the sandwich norms (the engine's post_attention_layernorm norms the
# attention's output, pre_mlp_layernorm the MLP's input, post_mlp_layernorm its output) and of the
# correction bias
_NORMS = {"post_attention_layernorm": "post_attn_norm", "pre_mlp_layernorm": "post_attention_layernorm",
          "post_mlp_layernorm": "post_ffn_norm"}
_NORM = re.compile(r"^(.*\.)(post_attention_layernorm|pre_mlp_layernorm|post_mlp_layernorm)\.weight$")
_BIAS = re.compile(r"^(.*\.)mlp\.gate\.e_score_correction_bias$")


def parse(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    window = raw.get("sliding_window")
    kinds = raw.get("layer_types") or ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
                                       for i in range(layers)]
    kinds = layer_kinds("layer_types", kinds, layers, ("full_attention", "sliding_attention"))
    shared = int(raw.get("shared_expert_intermediate_size") or 0)
    spec = moe(raw | {"norm_topk_prob": raw.get("norm_topk_prob", True)}, tuple(range(layers)), scoring="sigmoid",
               biased=True, bias_on_logits=True, shared_intermediate_size=shared)
    sliding = windows_by_kind(raw, kinds, 0) if window else ()
    return ModelConfig(**base(raw, intermediate_size=0, qk_norm="head", moe=spec, sandwich_norms=True,
                              sliding_window=sliding,
                              nope_layers=tuple(i for i, k in enumerate(kinds) if k == "full_attention") if window
                              else ()))


def _source(cfg: ModelConfig, name: str):
    """The published names: the norms (``_NORMS``), ``moe.router.expert_bias``, ``mlp.shared_experts``."""
    m = _NORM.match(name)
    if m:
        return f"{m.group(1)}{_NORMS[m.group(2)]}.weight", lambda t: t
    m = _BIAS.match(name)
    if m:
        return f"{m.group(1)}moe.router.expert_bias", lambda t: t
    return shared_experts(name)


FAMILY = Family("kolibri1", parse, source=_source)
