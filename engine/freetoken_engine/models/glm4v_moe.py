"""GLM-4.5V / GLM-4.6V (``glm4v_moe``) served as a text model.

Its language model is GLM-4.5-Air's (``text_config``: ``models/glm4_moe.py``'s routing, shared
experts, q/k/v biases and rotary over half of each head) under ``model.language_model``; the
vision tower (``model.visual``) is left unread and not packed. The multimodal rotary gives each
frequency section the temporal, height or width position id; for text all three are the token's
position, so it is the plain rotary.
"""
from __future__ import annotations

from ..config import ModelConfig
from ..errors import ConfigError
from . import glm4_moe
from .hf import Family


def parse(raw: dict) -> ModelConfig:
    text = dict(raw.get("text_config") or {})
    if not text:
        raise ConfigError("config.json of a glm4v_moe model lacks text_config")
    text.setdefault("eos_token_id", raw.get("eos_token_id"))
    if "tie_word_embeddings" in raw:             # the whole model's choice, as transformers ties it
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return glm4_moe.parse(dict(text, model_type="glm4v_moe", num_nextn_predict_layers=0))


FAMILY = Family("glm4v_moe", parse, model_prefix="model.language_model", source=glm4_moe.FAMILY.source,
                skip=lambda cfg, key: key.startswith("model.visual."))
