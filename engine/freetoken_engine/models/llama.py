"""Dense llama (and the attention + MLP that SmolLM2 uses)."""
from ..config import ModelConfig
from .hf import Family, base


def parse(raw: dict) -> ModelConfig:
    return ModelConfig(**base(raw))


FAMILY = Family("llama", parse)
