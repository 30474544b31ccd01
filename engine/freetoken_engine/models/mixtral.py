"""Mixtral: llama attention, softmax top-k with renormalised weights, w1/w3/w2 expert names."""
from dataclasses import replace

from ..config import ModelConfig
from .hf import Family, base, moe


def parse(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    window = raw.get("sliding_window")
    spec = moe(raw, tuple(range(layers)))
    return ModelConfig(**base(raw, sliding_window=(window,) * layers if window else (),
                             moe=replace(spec, norm_topk_prob=True)))


FAMILY = Family("mixtral", parse, moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"))
