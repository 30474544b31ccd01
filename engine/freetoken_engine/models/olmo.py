"""AllenAI's OLMo 2 and OLMo 3 (dense: ``olmo2``, ``olmo3``) and FlexOlmo (``flex_olmo``: OLMoE's
experts and routing in OLMo 2's layers). Every layer norms its branches' outputs before the
residual add instead of their inputs (``post_norms``), with q/k RMSNorm over the whole
projections. OLMo 3 has sliding-window layers (``layer_types``; by default three of every four)
and a rotary per layer type: ``rope_parameters`` keyed ``sliding_attention`` / ``full_attention``
(a plain ``rope_scaling`` scales the full layers only, as transformers reads it; both kinds take
the config's ``rope_theta``, where transformers 5.25 gives the sliding layers its default of
500,000 instead: the same for OLMo 3's published configs, which name 500,000)."""
from __future__ import annotations

from ..config import ModelConfig, RopeConfig
from ..errors import ConfigError
from .hf import Family, base, layer_kinds, moe, windows_by_kind

_KINDS = ("sliding_attention", "full_attention")


def parse_olmo2(raw: dict) -> ModelConfig:
    return ModelConfig(**base(raw, qk_norm="full", post_norms=True))


def parse_flex(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    return ModelConfig(**base(raw, qk_norm="full", post_norms=True, moe=moe(raw, tuple(range(layers)))))


def parse_olmo3(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    kinds = layer_kinds("layer_types", kinds, layers, _KINDS)
    ropes = _ropes(raw)
    return ModelConfig(**base(raw, qk_norm="full", post_norms=True, rope=ropes["full_attention"],
                              sliding_window=windows_by_kind(raw, kinds, 4096),
                              layer_ropes=tuple(ropes[k] for k in kinds)))


def _ropes(raw: dict) -> dict[str, RopeConfig]:
    """Each layer type's rotary: its own ``rope_parameters`` entry, or, in the flat form, the
    shared base with ``rope_scaling`` on the full-attention layers only."""
    params = raw.get("rope_parameters") or {}
    flat = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")}
    if set(params) & set(_KINDS):
        missing = [k for k in _KINDS if not isinstance(params.get(k), dict)]
        if missing:
            raise ConfigError(f"config.json: rope_parameters names no rotary for {', '.join(missing)} layers")
        return {k: RopeConfig.from_hf(dict(flat, rope_parameters=params[k])) for k in _KINDS}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    plain = RopeConfig.from_hf(dict(flat, rope_theta=theta))
    return {"sliding_attention": plain, "full_attention": RopeConfig.from_hf(raw)}


FAMILIES = (Family("olmo2", parse_olmo2), Family("olmo3", parse_olmo3), Family("flex_olmo", parse_flex))
