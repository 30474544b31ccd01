"""Phi-3.5-MoE, Phi-mini-MoE, Phi-tiny-MoE (``phimoe``): Mixtral's layout (``block_sparse_moe``
with w1/w3/w2 experts, a router ``gate``) with LayerNorms that have biases, q/k/v/o biases
(``attention_bias``), an LM head with a bias (``lm_head_bias``), the longrope rotary, and
sparsemixer routing: two experts chosen one after the other, each weighted by a softmax over
the router logits near it (``router_jitter_noise`` sets how near; layers/moe.py)."""
from __future__ import annotations

from dataclasses import replace

from ..config import ModelConfig
from .hf import Family, base, moe


def parse(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    window = raw.get("sliding_window")
    spec = moe(raw, tuple(range(layers)))
    return ModelConfig(**base(raw, sliding_window=(window,) * layers if window else (), layer_norm=True,
                             rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                             lm_head_bias=bool(raw.get("lm_head_bias", False)),
                             moe=replace(spec, scoring="sparsemixer",
                                         jitter_eps=float(raw.get("router_jitter_noise", 0.01)))))


FAMILY = Family("phimoe", parse, moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"))
