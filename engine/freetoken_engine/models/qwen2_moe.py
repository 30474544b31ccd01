"""Qwen2-MoE (Qwen1.5-MoE): q/k/v bias, routed experts plus a sigmoid-gated shared expert."""
from ..config import ModelConfig
from .hf import Family, base, moe, sliding, sparse_layers


def parse(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    return ModelConfig(**base(
        raw, qkv_bias=bool(raw.get("qkv_bias", True)), o_bias=False,
        sliding_window=sliding(raw, layers, bool(raw.get("use_sliding_window"))),
        moe=moe(raw, sparse_layers(raw, layers),
                shared_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
                shared_gate=True)))


FAMILY = Family("qwen2_moe", parse)
