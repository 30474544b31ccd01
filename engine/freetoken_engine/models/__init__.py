"""Model families keyed by ``model_type``; each file only translates its config and key names,
and every family composes the same layers (``models/decoder.py``)."""
from __future__ import annotations

from ..errors import ConfigError
from . import (afmoe, cohere2_moe, deepseek, ernie4_5_moe, exaone_moe, freetoken_llama_moe, glm4_moe, glm4v_moe, gpt_oss,
               granitemoe, granitemoehybrid, hunyuan_v1_moe, kimi_linear, kolibri, lfm2_moe, llama, llama4, minicpm5_moe,
               minimax_m2, mixtral, olmo, olmoe, phimoe, qwen2_moe, qwen3, qwen3_moe, qwen3_next, qwen3_omni_moe,
               qwen3_vl_moe, sarvam)
from .hf import Family

REGISTRY: dict[str, Family] = {
    f.model_type: f
    for f in (*(m.FAMILY for m in (llama, qwen3, qwen3_moe, qwen2_moe, mixtral, olmoe, glm4_moe, qwen3_vl_moe,
                               ernie4_5_moe, minimax_m2, exaone_moe, hunyuan_v1_moe, afmoe, lfm2_moe,
                               glm4v_moe, freetoken_llama_moe, granitemoehybrid, kimi_linear, qwen3_omni_moe,
                               minicpm5_moe, phimoe, cohere2_moe, gpt_oss, kolibri)),
              glm4_moe.DOTS1, glm4_moe.SOLAR_OPEN, ernie4_5_moe.VL, llama.MISTRAL, llama.QWEN2, exaone_moe.HY_V3, qwen3_moe.FLINT, *qwen3_next.FAMILIES, *granitemoe.FAMILIES,
              *deepseek.FAMILIES, *sarvam.FAMILIES, *olmo.FAMILIES,
              *llama4.FAMILIES)
}


def family(model_type: str | None) -> Family:
    if model_type not in REGISTRY:
        raise ConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[model_type]
