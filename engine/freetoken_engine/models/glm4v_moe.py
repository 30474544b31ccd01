"""GLM-4.5V / GLM-4.6V (``glm4v_moe``) served as a text model.

Its language model is GLM-4.5-Air's (``text_config``: ``models/glm4_moe.py``'s routing, shared
experts, q/k/v biases and rotary over half of each head) under ``model.language_model``; the
vision tower (``model.visual``) is left unread and not packed. The multimodal rotary gives each
frequency section the temporal, height or width position id; for text all three are the token's
position, so it is the plain rotary.
"""
from __future__ import annotations

from ..config import ModelConfig
from . import glm4_moe
from .hf import Family, language_model


def parse(raw: dict) -> ModelConfig:
    return glm4_moe.parse(dict(language_model(raw, "glm4v_moe"), num_nextn_predict_layers=0))


FAMILY = Family("glm4v_moe", parse, model_prefix="model.language_model", source=glm4_moe.FAMILY.source,
                skip=lambda cfg, key: key.startswith("model.visual."))
