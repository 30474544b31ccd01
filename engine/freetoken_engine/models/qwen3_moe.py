"""Qwen3-MoE: Qwen3 attention, softmax top-k routing over routed experts (no shared expert)."""
from ..config import ModelConfig
from .hf import Family, base, moe, sliding, sparse_layers


def parse(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    return ModelConfig(**base(raw, qk_norm="head",
                             sliding_window=sliding(raw, layers, True),  # as transformers: any window applies
                             moe=moe(raw, sparse_layers(raw, layers))))


FAMILY = Family("qwen3_moe", parse)
