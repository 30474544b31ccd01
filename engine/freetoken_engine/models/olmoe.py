"""OLMoE: q/k RMSNorm over the whole projection, optional qkv clipping, softmax top-k."""
from ..config import ModelConfig
from .hf import Family, base, moe


def parse(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    clip = raw.get("clip_qkv")
    return ModelConfig(**base(raw, qk_norm="full", clip_qkv=float(clip) if clip is not None else None,
                             moe=moe(raw, tuple(range(layers)))))


FAMILY = Family("olmoe", parse)
