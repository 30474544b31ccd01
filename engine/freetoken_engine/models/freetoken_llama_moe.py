"""The project's MoEfied llama (the embedded default model): llama attention, a linear router,
top-k experts each added with weight 1 (``router_scoring: unit``), so top-k = E is the dense MLP."""
from ..config import ModelConfig
from .hf import Family, base, moe


def parse(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    return ModelConfig(**base(raw, moe=moe(raw, tuple(range(layers)),
                                          scoring=raw.get("router_scoring", "unit"))))


FAMILY = Family("freetoken_llama_moe", parse)
