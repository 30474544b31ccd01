"""Qwen3-MoE: Qwen3 attention, softmax top-k routing over routed experts (no shared expert); and
Flint (``flint``): Qwen3-MoE's layers with an attention sink per query head on every layer, the
rotary on the sliding-window layers only (the full-attention ones use no position encoding),
sigmoid scores of the top k logits renormalised, a shared expert (no gate on its output) beside the routed ones,
and dense layers by ``mlp_only_layers`` (by default the first two); its sinks are published as
``self_attn.softmax_offset``."""
from dataclasses import replace

from ..config import ModelConfig
from .hf import Family, base, layer_kinds, moe, sliding, sparse_layers, windows_by_kind


def parse(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    return ModelConfig(**base(raw, qk_norm="head",
                             sliding_window=sliding(raw, layers, True),  # as transformers: any window applies
                             moe=moe(raw, sparse_layers(raw, layers))))


def parse_flint(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types") or ["full_attention" if i < 2 or i % 4 == 1 or i == layers - 1
                                       else "sliding_attention" for i in range(layers)]
    kinds = layer_kinds("layer_types", kinds, layers, ("full_attention", "sliding_attention"))
    raw = raw | {"mlp_only_layers": raw.get("mlp_only_layers", [0, 1]),
                 "norm_topk_prob": raw.get("norm_topk_prob", True), "sliding_window": raw.get("sliding_window") or 513}
    spec = replace(moe(raw, sparse_layers(raw, layers)), scoring="sigmoid", router_fp32=True,
                   shared_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0))
    return ModelConfig(**base(raw, qk_norm="head", attn_sinks=True, moe=spec,
                              sliding_window=windows_by_kind(raw, kinds, 513),
                              nope_layers=tuple(i for i, k in enumerate(kinds) if k == "full_attention")))


def _source_flint(cfg: ModelConfig, name: str):
    """Flint's published name of the attention sinks: ``self_attn.softmax_offset``."""
    if name.endswith(".self_attn.sinks"):
        return name[:-len("sinks")] + "softmax_offset", lambda t: t
    return None


FAMILY = Family("qwen3_moe", parse)
FLINT = Family("flint", parse_flint, source=_source_flint)
