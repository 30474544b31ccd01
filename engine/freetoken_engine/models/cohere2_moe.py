"""Cohere's MoE (``cohere2_moe``: Command A Plus). Each layer norms its input once (a LayerNorm
with a weight only, or an RMSNorm where the config names ``rms_norm_eps``) and adds the
attention's and the MLP's outputs to the residual together (``parallel_block``). Sliding-window
layers rotate (Cohere's interleaved pairs, reordered into the engine's halves as q/k rows are
read); the full-attention layers rotate nothing, unless they are the dense prefix's and
``prefix_dense_sliding_window_pattern`` is 1. The routed experts are chosen by the top logits and
weighted by their softmax (or, ``expert_selection_fn: sigmoid``, their sigmoids, renormalised with
``norm_topk_prob``); shared experts beside them, summed or averaged with them
(``shared_expert_combination_strategy``); the logits times ``logit_scale``."""
from __future__ import annotations

from ..config import ModelConfig
from ..errors import ConfigError
from .hf import Family, base, interleaved_rotary, layer_kinds, moe, need, shared_experts



def parse(raw: dict) -> ModelConfig:
    layers = int(need(raw, "num_hidden_layers"))
    dense = int(raw.get("first_k_dense_replace", 0) or 0)
    kinds = layer_kinds("layer_types", raw.get("layer_types") or _default_kinds(raw, layers, dense), layers,
                        ("sliding_attention", "full_attention"))
    mlp = layer_kinds("mlp_layer_types", raw.get("mlp_layer_types")
                      or ["dense" if i < dense else "sparse" for i in range(layers)], layers, ("dense", "sparse"))
    select, combine = raw.get("expert_selection_fn", "softmax"), raw.get("shared_expert_combination_strategy", "average")
    if select not in ("softmax", "sigmoid") or combine not in ("sum", "average"):
        raise ConfigError(f"config.json: expert_selection_fn {select!r} / shared_expert_combination_strategy "
                          f"{combine!r}: softmax or sigmoid / sum or average")
    forced = int(raw.get("prefix_dense_sliding_window_pattern", 1) or 1) == 1
    nope = tuple(i for i, k in enumerate(kinds) if k == "full_attention" and not (forced and mlp[i] == "dense"))
    window = raw.get("sliding_window")
    inter = int(need(raw, "intermediate_size"))
    spec = moe(raw | {"norm_topk_prob": select == "softmax" or bool(raw.get("norm_topk_prob", True))},
               tuple(i for i, k in enumerate(mlp) if k == "sparse"), scoring=select,
               shared_intermediate_size=inter * int(raw.get("num_shared_experts", 0) or 0),
               average_shared=combine == "average" and bool(raw.get("num_shared_experts")))
    scale = float(raw.get("logit_scale", 1.0) or 1.0)
    rms = raw.get("rms_norm_eps")
    return ModelConfig(**base(
        raw | {"rms_norm_eps": rms if rms is not None else raw.get("layer_norm_eps", 1e-5)}, intermediate_size=int(raw.get("prefix_dense_intermediate_size") or inter), moe=spec, nope_layers=nope,
        sliding_window=tuple(int(window) if k == "sliding_attention" else None for k in kinds) if window else (),
        parallel_block=True, layer_norm=rms is None, layer_norm_bias=False, logits_scaling=1.0 / scale, tie_word_embeddings=bool(raw.get("tie_word_embeddings", True))))


def _default_kinds(raw: dict, layers: int, dense: int) -> list[str]:
    """transformers' defaults: the dense prefix every ``prefix_dense_sliding_window_pattern``-th
    layer global, the rest every ``sliding_window_pattern``-th."""
    prefix = int(raw.get("prefix_dense_sliding_window_pattern", 1) or 1)
    every = int(raw.get("sliding_window_pattern", 4) or 4)
    return ([("sliding_attention" if (i + 1) % prefix else "full_attention") for i in range(dense)]
            + [("sliding_attention" if (i + 1) % every else "full_attention") for i in range(layers - dense)])


def _source(cfg: ModelConfig, name: str):
    return interleaved_rotary(cfg, name) or shared_experts(name)


FAMILY = Family("cohere2_moe", parse, source=_source)
