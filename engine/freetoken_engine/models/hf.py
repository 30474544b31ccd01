"""Shared translation of Hugging Face ``config.json`` fields into ``ModelConfig``."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import ModelConfig, MoeConfig, RopeConfig
from ..errors import ConfigError


@dataclass(frozen=True)
class Family:
    """How one ``model_type`` is read: its config translation and routed-expert key names."""

    model_type: str
    parse: Callable[[dict], ModelConfig]
    moe_prefix: str = "mlp"                                   # model.layers.{i}.<moe_prefix>
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    model_prefix: str = "model"                               # <model_prefix>.layers.{i}, .embed_tokens, .norm
    lm_head: str = "lm_head.weight"                           # the checkpoint's key of the output projection
    # engine parameter -> (the engine-side name of the tensor it comes from, how), for tensors
    # whose layout or convention differs from the engine's; None: the tensor of its own name as it is
    source: Callable[[ModelConfig, str], tuple[str, Callable] | None] | None = None
    # checkpoint keys the engine never reads (a layer it does not run): left out of a packed folder
    skip: Callable[[ModelConfig, str], bool] | None = None
    # the fused pair may be stored transposed, gate_up_proj [E, H, 2I] and down_proj [E, I, H], as
    # Qwen3-VL-MoE is published (transformers writes it untransposed): told apart by their shapes
    fused_transposed: bool = False
    # the fused pair's names within the MoE block (Granite: input_linear.weight, output_linear.weight)
    fused_names: tuple[str, str] = ("experts.gate_up_proj", "experts.down_proj")
    # the fused pair's gate and up rows alternate (gpt-oss: gate rows 0, 2, 4..., up rows 1, 3, 5...)
    interleaved_gate_up: bool = False
    # the key prefix of the multi-token-prediction layer the checkpoint ships: Qwen3-Next's
    # ``mtp.layers.0`` (its other parts ``mtp.*``); GLM's and DeepSeek's the layer after the
    # model's own, ``model.layers.{N}``, its parts mapped to the engine's by ``source``
    mtp_layer: Callable[[ModelConfig], str] = lambda cfg: "mtp.layers.0"

    def has_mtp(self, cfg: ModelConfig, names) -> bool:
        """Whether checkpoint tensor ``names`` hold the MTP layer's."""
        stem = self.mtp_layer(cfg) + "."
        return any(k.startswith(stem) for k in names)

    def layer_stem(self, layer: int | str) -> str:
        """The key prefix of a layer: ``<model_prefix>.layers.{layer}``, or ``layer`` itself when
        it is a string (a multi-token-prediction layer: ``mtp.layers.0``)."""
        return layer if isinstance(layer, str) else f"{self.model_prefix}.layers.{layer}"

    def expert_key(self, layer: int | str, expert: int, proj: int) -> str:
        return f"{self.layer_stem(layer)}.{self.moe_prefix}.experts.{expert}.{self.expert_names[proj]}.weight"

    def fused_expert_keys(self, layer: int | str) -> tuple[str, str]:
        """A layer's routed experts as two stacked tensors, as transformers 5 holds them and as
        Qwen3.5/3.6-MoE are published: ``experts.gate_up_proj [E, 2I, H]`` (each expert's gate
        rows, then its up rows) and ``experts.down_proj [E, H, I]``."""
        stem = f"{self.layer_stem(layer)}.{self.moe_prefix}."
        return stem + self.fused_names[0], stem + self.fused_names[1]

    def expert_dtype(self, ckpt, layer: int | str) -> torch.dtype:
        """The dtype ``layer_experts`` yields ``layer``'s first expert in (its gate weight's), from
        the checkpoint's header: nothing is read."""
        gate_up_key, _ = self.fused_expert_keys(layer)
        return ckpt.dtype(gate_up_key if ckpt.has(gate_up_key) else self.expert_key(layer, 0, 0))

    def layer_experts(self, ckpt, layer: int | str, num_experts: int, shape: tuple[int, int] | None = None,
                      down_scale: float = 1.0):
        """``(gate [I, H], up [I, H], down [H, I])`` of each routed expert of ``layer`` (an index,
        or a layer's key prefix: ``layer_stem``), in order, from ``ckpt``
        (``models/loader.Checkpoint``) in whichever form it stores them: per-expert tensors
        (``expert_key``) or the fused pair (``fused_expert_keys``), whose slices are views of one
        read. ``shape``: the model's (hidden, intermediate), which tells a transposed pair apart.
        ``down_scale``: each down weight times it (``ModelConfig.residual_multiplier``, folded).
        Raises ``ConfigError`` for a fused pair that does not fit."""
        if down_scale != 1.0:
            for gate, up, down in self.layer_experts(ckpt, layer, num_experts, shape):
                yield gate, up, down * down_scale
            return
        gate_up_key, down_key = self.fused_expert_keys(layer)
        if not ckpt.has(gate_up_key):
            for e in range(num_experts):
                yield tuple(ckpt.get(self.expert_key(layer, e, p)) for p in range(3))
            return
        if not ckpt.has(down_key):
            raise ConfigError(f"checkpoint has {gate_up_key} but lacks {down_key}")
        gate_up, down = ckpt.get(gate_up_key), ckpt.get(down_key)
        if self.fused_transposed and shape and gate_up.dim() == 3 and down.dim() == 3:
            h, i = shape
            if (tuple(down.shape[1:]) == (i, h) and i != h) or (tuple(gate_up.shape[1:]) == (h, 2 * i) and h != 2 * i):
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2:
            raise ConfigError(f"{gate_up_key} has shape {tuple(gate_up.shape)} and {down_key} "
                              f"{tuple(down.shape)}: expected [experts, 2 x intermediate, hidden] and "
                              f"[experts, hidden, intermediate]")
        if gate_up.shape[0] != num_experts or down.shape[0] != num_experts:
            raise ConfigError(f"{gate_up_key} holds {gate_up.shape[0]} experts and {down_key} "
                              f"{down.shape[0]}; config.json says {num_experts}")
        inter = gate_up.shape[1] // 2
        for e in range(num_experts):
            if self.interleaved_gate_up:
                yield gate_up[e, 0::2], gate_up[e, 1::2], down[e]
            else:
                yield gate_up[e, :inter], gate_up[e, inter:], down[e]

    def stores_expert_rows(self, ckpt, layer: int | str, shape: tuple[int, int]) -> bool:
        """Whether ``layer_expert_rows`` can give ``layer``'s experts (their fused tensors stored in
        MXFP4, widths multiples of 32), from the checkpoint's index alone."""
        is4 = getattr(ckpt, "is_mxfp4", None)
        return (is4 is not None and shape[0] % 32 == 0 and shape[1] % 32 == 0
                and all(is4(k) for k in self.fused_expert_keys(layer)))

    def layer_expert_rows(self, ckpt, layer: int | str, num_experts: int, shape: tuple[int, int]):
        """``(w13 [2I, rb(H)], w2 [H, rb(I)])`` MXFP4 rows (rb = kernels/mxfp4.py row_bytes; gate rows then up
        rows) of each routed expert of ``layer``, in order, when ``ckpt`` stores the layer's fused
        experts in MXFP4 as published (rows the output features: gpt-oss's); None otherwise."""
        from ..kernels.mxfp4 import row_bytes
        rows = getattr(ckpt, "mxfp4_rows", None)
        gate_up_key, down_key = self.fused_expert_keys(layer)
        gate_up = rows(gate_up_key) if rows else None
        down = rows(down_key) if gate_up is not None else None
        h, i = shape
        if down is None or h % 32 or i % 32 or tuple(gate_up.shape) != (num_experts, 2 * i, row_bytes(h)) \
                or tuple(down.shape) != (num_experts, h, row_bytes(i)):
            return None
        if self.interleaved_gate_up:
            gate_up = torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1)
        return ((gate_up[e], down[e]) for e in range(num_experts))

    def rename(self, key: str) -> str:
        """Checkpoint key -> engine module key (non-expert tensors)."""
        if key == self.lm_head:
            return "lm_head.weight"
        if self.moe_prefix != "mlp":
            key = key.replace(f".{self.moe_prefix}.", ".mlp.")
        if self.model_prefix != "model" and key.startswith(self.model_prefix + "."):
            key = "model." + key[len(self.model_prefix) + 1:]
        return key


_SHARED_EXPERT = re.compile(r"^(.*\.mlp\.)shared_expert\.(.*)$")
_QK = re.compile(r"\.self_attn\.[qk]_proj\.(weight|bias)$")


def interleaved_rotary(cfg: ModelConfig, name: str) -> tuple[str, Callable] | None:
    """A ``Family.source`` rule for checkpoints whose rotary turns interleaved pairs of each head
    (dimensions 2j, 2j + 1: ERNIE-4.5, Llama 4, Cohere): q_proj's and k_proj's rows (and biases)
    reordered within each head, ``[0, 2, 4, ...; 1, 3, 5, ...]``, into the engine's halves.
    Attention scores are sums over a head's dimensions, the same in any order q and k share."""
    if not _QK.search(name):
        return None
    half = cfg.head_dim // 2
    return name, lambda t: t.reshape(-1, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def shared_experts(name: str) -> tuple[str, Callable] | None:
    """A ``Family.source`` rule: the engine's ``mlp.shared_expert`` is the checkpoint's
    ``mlp.shared_experts`` (GLM-4.5, ERNIE-4.5, dots.llm1: ungated, one MLP for them all)."""
    m = _SHARED_EXPERT.match(name)
    return (f"{m.group(1)}shared_experts.{m.group(2)}", lambda t: t) if m else None


def need(raw: dict, *names: str):
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    raise ConfigError(f"config.json lacks {names[0]}")


def eos_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def base(raw: dict, **overrides) -> dict:
    """Fields every family shares, as ``ModelConfig`` keyword arguments."""
    heads = int(need(raw, "num_attention_heads"))
    hidden = int(need(raw, "hidden_size"))
    layers = int(need(raw, "num_hidden_layers"))
    fields = dict(
        model_type=raw["model_type"], vocab_size=int(need(raw, "vocab_size")), hidden_size=hidden,
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw.get("intermediate_size") or 0),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope=RopeConfig.from_hf(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", False)), o_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)), eos_token_ids=eos_ids(raw),
        bos_token_id=raw.get("bos_token_id"),
    )
    fields.update(overrides)
    return fields


def sliding(raw: dict, layers: int, enabled: bool) -> tuple[int | None, ...]:
    """Per-layer window: qwen-style ``use_sliding_window`` + ``max_window_layers``/``layer_types``."""
    window = raw.get("sliding_window")
    if not enabled or not window:
        return ()
    types = raw.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * layers


def windows_by_kind(raw: dict, kinds: list[str], default: int) -> tuple[int | None, ...]:
    """Each layer's sliding window: ``sliding_window`` (else ``default``) on the layers ``kinds``
    names "sliding_attention", none on the others; a ConfigError for a window that is no number of
    tokens."""
    window = raw.get("sliding_window", default)
    if not isinstance(window, (int, float)) or int(window) < 1:
        raise ConfigError(f"config.json: sliding_window must be a positive number of tokens, got {window}")
    return tuple(int(window) if k == "sliding_attention" else None for k in kinds)


def layer_kinds(name: str, kinds, layers: int, allowed: tuple[str, ...]) -> list[str]:
    """``kinds`` (a per-layer list such as ``layer_types``) when it names each of the ``layers``
    layers one of ``allowed``, else a ConfigError that says so."""
    if not kinds or len(kinds) != layers or not set(kinds) <= set(allowed):
        raise ConfigError(f"config.json: {name} must name each of the {layers} layers one of "
                          f"{', '.join(allowed)}, got {kinds}")
    return list(kinds)


def language_model(raw: dict, model_type: str) -> dict:
    """A multimodal checkpoint's ``text_config`` as a config of its own, with the whole model's
    EOS and, where it gives one, its choice to tie the embeddings (as transformers ties them)."""
    text = dict(raw.get("text_config") or {})
    if not text:
        raise ConfigError(f"config.json of a {model_type} model lacks text_config")
    text.setdefault("eos_token_id", raw.get("eos_token_id"))
    if "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return dict(text, model_type=model_type)


def sparse_layers(raw: dict, layers: int) -> tuple[int, ...]:
    """Qwen-style ``decoder_sparse_step`` and ``mlp_only_layers``."""
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


def moe(raw: dict, layers: tuple[int, ...], **kw) -> MoeConfig:
    return MoeConfig(
        num_experts=int(need(raw, "num_experts", "num_local_experts")),
        top_k=int(need(raw, "num_experts_per_tok")),
        intermediate_size=int(need(raw, "moe_intermediate_size", "intermediate_size")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)), layers=layers, **kw)
