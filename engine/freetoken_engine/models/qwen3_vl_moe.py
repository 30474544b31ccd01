"""Qwen3-VL-MoE (``qwen3_vl_moe``: Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B) served as a text model.

Its language model is Qwen3-MoE's (``text_config``; q/k RMSNorm per head, softmax top k, always
renormalised) under ``model.language_model``, its routed experts stacked and stored transposed
(``experts.gate_up_proj [E, H, 2I]``, ``experts.down_proj [E, I, H]``). The vision tower is left
unread. The interleaved multimodal rotary gives each frequency the temporal, height or width
position id; for text all three are the token's position, so it is the plain rotary.
"""
from __future__ import annotations

from dataclasses import replace

from ..config import ModelConfig
from . import qwen3_moe
from .hf import Family, language_model


def parse(raw: dict) -> ModelConfig:
    cfg = qwen3_moe.parse(language_model(raw, "qwen3_vl_moe"))
    return replace(cfg, moe=replace(cfg.moe, norm_topk_prob=True))


FAMILY = Family("qwen3_vl_moe", parse, model_prefix="model.language_model", fused_transposed=True)
