"""Qwen3-Omni-MoE (``qwen3_omni_moe``: Qwen3-Omni-30B-A3B-Instruct / -Thinking / -Captioner) served as
a text model: its thinker's language model, Qwen3-MoE's (``thinker_config.text_config``; q/k RMSNorm
per head, softmax top k, renormalised) under ``thinker.model``, its output projection
``thinker.lm_head``. The audio and vision towers, the talker and the speech decoder are left unread.
The thinker's multimodal rotary gives each frequency the temporal, height or width position; for
text all three are the token's position, so it is the plain rotary.
"""
from __future__ import annotations

from dataclasses import replace

from ..config import ModelConfig
from ..errors import ConfigError
from . import qwen3_moe
from .hf import Family, language_model


def parse(raw: dict) -> ModelConfig:
    thinker = raw.get("thinker_config")
    if not isinstance(thinker, dict):
        raise ConfigError("config.json of a qwen3_omni_moe model lacks thinker_config")
    text = language_model(dict(thinker, eos_token_id=thinker.get("eos_token_id", raw.get("eos_token_id"))),
                          "qwen3_omni_moe")
    cfg = qwen3_moe.parse(text)
    return replace(cfg, moe=replace(cfg.moe, norm_topk_prob=bool(text.get("norm_topk_prob", True))))


FAMILY = Family("qwen3_omni_moe", parse, model_prefix="thinker.model", lm_head="thinker.lm_head.weight")
