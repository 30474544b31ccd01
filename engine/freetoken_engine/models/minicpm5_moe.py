"""MiniCPM5-MoE (``minicpm5_moe``: MiniCPM5-15B-A2.5B): attention whose ``q_proj`` also yields, per
head, a sigmoid gate of the head's output (Qwen3-Next's layout: each head's query rows, then its
gate rows), full rotary, no q/k norm; DeepSeek-V3's MoE (sigmoid scores, a correction bias that
steers the choice, group-limited top k, renormalised, times ``routed_scaling_factor``, a float32
router) with ungated shared experts (``mlp.shared_experts``), after the dense layers that
``mlp_layer_types`` names (by default the first).
"""
from __future__ import annotations

from ..config import ModelConfig
from . import glm4_moe
from .hf import Family, base


def parse(raw: dict) -> ModelConfig:
    return ModelConfig(**base(raw, attn_gate=True, moe=glm4_moe.routed_by_kinds(raw)))


FAMILY = Family("minicpm5_moe", parse, source=glm4_moe.FAMILY.source)
