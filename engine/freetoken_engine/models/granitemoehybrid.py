"""IBM Granite 4.0's hybrids (``granitemoehybrid``: granite-4.0-h-tiny, -h-small, and the dense
-h-micro): most layers mix tokens by Mamba-2 (``layer_types`` "mamba" / "linear_attention";
``layers/mamba2.py``, its state in the ``StatePool`` as the other hybrids'), the rest by attention,
without any position encoding unless ``position_embedding_type`` is "rope" (the identity rotation
otherwise, as EXAONE's global layers). Every layer's MLP is Granite 3.x's MoE (``granitemoe``: the
fused ``input_linear`` / ``output_linear`` experts, ``router.layer``, softmax over the top k
logits) beside the ungated ``shared_mlp``, or, with ``num_local_experts`` 0, the shared MLP alone;
Granite's four multipliers (the residual one folded into the weights that end each branch,
``out_proj`` of a Mamba-2 layer among them).
"""
from __future__ import annotations

import math
import re

from ..config import LinearAttnConfig, ModelConfig
from ..errors import ConfigError
from . import granitemoe
from .hf import Family, base, layer_kinds, moe, need

_MIXER = re.compile(r"^(.*\.)linear_attn\.(.*)$")
_DENSE = re.compile(r"^(.*\.)mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}


def _number(v) -> float:
    """A config number; transformers writes an infinite one as ``{"__float__": "Infinity"}``."""
    return float(v["__float__"] if isinstance(v, dict) and "__float__" in v else v)


def _mamba(raw: dict, hidden: int) -> LinearAttnConfig:
    heads, groups = int(raw.get("mamba_n_heads", 128)), int(raw.get("mamba_n_groups", 1))
    inner = int(raw.get("mamba_expand", 2)) * hidden
    head = raw.get("mamba_d_head", "auto")
    head = inner // heads if head in (None, "auto") else int(head)
    if head * heads != inner:
        raise ConfigError(f"config.json: mamba_n_heads {heads} x mamba_d_head {head} must equal mamba_expand x "
                          f"hidden_size ({inner})")
    limit = [_number(v) for v in raw.get("time_step_limit") or (0.0, math.inf)]
    return LinearAttnConfig(k_heads=groups, v_heads=heads, k_dim=int(raw.get("mamba_d_state", 256)), v_dim=head,
                            conv=int(raw.get("mamba_d_conv", 4)), kind="mamba2", bias=bool(raw.get("mamba_conv_bias", True)),
                            proj_bias=bool(raw.get("mamba_proj_bias", False)),
                            dt_limit=(limit[0], limit[1]))


def parse(raw: dict) -> ModelConfig:
    layers = int(need(raw, "num_hidden_layers"))
    kinds = [_KINDS.get(k, k) for k in raw.get("layer_types") or ["linear_attention"] * layers]
    kinds = layer_kinds("layer_types", kinds, layers, ("linear_attention", "full_attention"))
    experts = int(raw.get("num_local_experts", 8) or 0)
    shared = int(raw.get("shared_intermediate_size") or 0)
    if not shared:
        raise ConfigError("config.json: Granite 4.0 needs shared_intermediate_size (its shared MLP)")
    position = raw.get("position_embedding_type")
    attention = tuple(i for i, k in enumerate(kinds) if k == "full_attention")
    fields = base(raw, **granitemoe._multipliers(raw), linear_layers=tuple(i for i, k in enumerate(kinds)
                                                                           if k == "linear_attention"),
                  linear=_mamba(raw, int(need(raw, "hidden_size"))),
                  nope_layers=() if position == "rope" else attention)
    if experts:
        fields.update(intermediate_size=0, moe=moe(raw | {"norm_topk_prob": True, "num_experts": experts},
                                                  tuple(range(layers)), shared_intermediate_size=shared))
    else:
        fields.update(intermediate_size=shared)
    return ModelConfig(**fields)


def _source(cfg: ModelConfig, name: str):
    """Mamba-2's tensors are ``mamba.*``; the dense form's MLP is the shared MLP's halves; the
    rest as Granite 3.x's MoE."""
    m = _MIXER.match(name)
    if m:
        return f"{m.group(1)}mamba.{m.group(2)}", lambda t: t
    m = _DENSE.match(name)
    if m and cfg.moe is None:
        inter = cfg.intermediate_size
        if m.group(2) == "down_proj":
            return f"{m.group(1)}shared_mlp.output_linear.weight", lambda t: t
        half = slice(0, inter) if m.group(2) == "gate_proj" else slice(inter, 2 * inter)
        return f"{m.group(1)}shared_mlp.input_linear.weight", lambda t: granitemoe._rows(t, half, 2 * inter)
    return granitemoe._source(cfg, name)


FAMILY = Family("granitemoehybrid", parse, moe_prefix="block_sparse_moe", source=_source,
                fused_names=("input_linear.weight", "output_linear.weight"))
