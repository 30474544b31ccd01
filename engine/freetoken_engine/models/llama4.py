"""Meta's Llama 4 (``llama4``: Llama-4-Scout-17B-16E, -Maverick-17B-128E, served as text: the
vision tower left unread; ``llama4_text``). Every ``interleave_moe_layer_step``-th layer's MLP
is MoE: one routed expert a token, chosen by the top router logit, whose sigmoid scales the
expert's input (not its output), beside a shared expert of the same size; the other layers a
dense MLP of ``intermediate_size_mlp``. Layers named by ``no_rope_layers`` (by default every
fourth) rotate nothing and scale their queries by a temperature of the position; the others
rotate (Meta's interleaved pairs, reordered into the engine's halves as q/k rows are read),
L2-norm each head's query and key after it, and attend within chunks of
``attention_chunk_size`` positions."""
from __future__ import annotations

import re

from ..config import ModelConfig, MoeConfig
from ..errors import ConfigError
from .hf import Family, base, interleaved_rotary, language_model, need

_ROUTER = re.compile(r"^(.*\.mlp\.)gate\.weight$")


def parse(raw: dict) -> ModelConfig:
    if raw.get("text_config") is not None:
        raw = language_model(raw, "llama4")
    layers = int(need(raw, "num_hidden_layers"))
    step = int(raw.get("interleave_moe_layer_step", 1) or 1)
    sparse = raw.get("moe_layers")
    sparse = tuple(sparse) if sparse is not None else tuple(range(step - 1, layers, step))
    interval = int(raw.get("no_rope_layer_interval", 4) or 4)
    rotary = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if len(rotary) != layers:
        raise ConfigError(f"config.json: no_rope_layers must name each of the {layers} layers (1: rotary, 0: none)")
    nope = tuple(i for i, r in enumerate(rotary) if not r)
    chunk = raw.get("attention_chunk_size")
    inter = int(need(raw, "intermediate_size"))
    spec = MoeConfig(num_experts=int(need(raw, "num_local_experts")), top_k=int(raw.get("num_experts_per_tok", 1)),
                     intermediate_size=inter, scoring="sigmoid", scale_input=True, shared_intermediate_size=inter,
                     layers=sparse)
    temper = (float(raw.get("floor_scale", 8192)), float(raw.get("attn_scale", 0.1))) \
        if raw.get("attn_temperature_tuning", True) else None
    return ModelConfig(**base(raw, intermediate_size=int(raw.get("intermediate_size_mlp") or inter), moe=spec,
                              nope_layers=nope, qk_norm="l2" if raw.get("use_qk_norm", True) else "none",
                              attention_chunks=tuple(int(chunk) if r else None for r in rotary) if chunk else (),
                              attn_temperature=temper, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5))))


def _source(cfg: ModelConfig, name: str):
    """q/k rows turned from Meta's interleaved pairs into halves, per head; the router is
    ``feed_forward.router``."""
    m = _ROUTER.match(name)
    return (f"{m.group(1)}router.weight", lambda t: t) if m else interleaved_rotary(cfg, name)


def _vision(cfg: ModelConfig, key: str) -> bool:
    return key.startswith(("vision_model.", "multi_modal_projector."))


_COMMON = dict(moe_prefix="feed_forward", source=_source, fused_transposed=True)
FAMILIES = (Family("llama4_text", parse, **_COMMON),
            Family("llama4", parse, model_prefix="language_model.model", lm_head="language_model.lm_head.weight",
                   skip=_vision, **_COMMON))
