"""Dense Qwen3: llama attention with per-head q/k RMSNorm."""
from ..config import ModelConfig
from .hf import Family, base, sliding


def parse(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    return ModelConfig(**base(raw, qk_norm="head",
                             sliding_window=sliding(raw, layers, bool(raw.get("use_sliding_window")))))


FAMILY = Family("qwen3", parse)
