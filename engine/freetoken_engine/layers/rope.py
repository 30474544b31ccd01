"""Rotary position embedding (rotate-half layout) with the scaling rules configs name."""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig, RopeConfig
from ..errors import ConfigError


def inverse_frequencies(rope: RopeConfig, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq [dim/2] float32, attention_scaling)`` for a rope config over the ``dim``
    rotated dimensions of a head (all of it, or its first ``partial_rotary_factor``)."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = 1.0
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif rope.type == "yarn":
        def correction_dim(rotations: float) -> float:
            return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (
                2 * math.log(rope.theta))
        low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = (inv / rope.factor) * (1 - extrapolation) + inv * extrapolation
        scaling = _yarn_factor(rope)
    elif rope.type == "longrope":
        return longrope(rope, dim, long=False)
    return inv, scaling


def longrope(rope: RopeConfig, dim: int, long: bool) -> tuple[torch.Tensor, float]:
    """A longrope's ``(inv_freq, cos/sin scale)`` below its original context (``long`` False:
    ``short_factor``, ``short_mscale``) or from there on (``long_factor``, ``long_mscale``);
    without the mscales, the attention factor of both (Phi-3.5-MoE's published code and
    transformers' ``_compute_longrope_parameters``)."""
    factors = rope.long_factor if long else rope.short_factor
    if len(factors) != dim // 2:
        raise ConfigError(f"config.json: longrope's factors name {len(factors)} frequencies; the rotary has {dim // 2}")
    base = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv = 1.0 / (torch.tensor(factors, dtype=torch.float32) * base)
    scale = rope.long_mscale if long else rope.short_mscale
    if scale is None:
        scale = rope.attention_factor
    if scale is None:
        scale = math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position)) if rope.factor > 1 else 1.0
    return inv, scale


def _mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude term ``0.1 m ln(factor) + 1`` (1 when nothing is stretched)."""
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn_factor(rope: RopeConfig) -> float:
    """The cos/sin scale of a yarn rotary: the config's ``attention_factor``, else DeepSeek's
    ``mscale`` over ``mscale_all_dim`` when both are given, else ``0.1 ln(factor) + 1``."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _mscale(rope.factor, rope.mscale) / _mscale(rope.factor, rope.mscale_all_dim)
    return _mscale(rope.factor)


class Rotary:
    """Computes cos/sin for given positions over the ``dim`` rotated dimensions of a head. A
    longrope rotates positions below its original context by its short factors and the rest by
    its long ones: a token's rotation depends on its own position only, so the KV written before
    a sequence crosses that length stays valid (Phi-3.5-MoE's published code switches the whole
    pass at once; the two agree up to the original context, and token by token in decode)."""

    def __init__(self, rope: RopeConfig, dim: int, max_position: int, device: torch.device):
        inv, self.scaling = inverse_frequencies(rope, dim, max_position)
        self.inv_freq = inv.to(device)
        self.long: tuple[int, torch.Tensor, float] | None = None     # (first position, inv_freq, scale)
        if rope.type == "longrope":
            inv_long, scale_long = longrope(rope, dim, long=True)
            self.long = (rope.original_max_position, inv_long.to(device), scale_long)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._cos_sin(positions, self.inv_freq, self.scaling, dtype)
        if self.long is not None:
            far = positions >= self.long[0]
            if bool(far.any()):
                cos[far], sin[far] = self._cos_sin(positions[far], self.long[1], self.long[2], dtype)
        return cos[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]

    @staticmethod
    def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype):
        freqs = positions.float()[:, None] * inv_freq[None, :]            # [T, d/2]
        return (torch.cat((freqs, freqs), dim=-1).cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (cos [T, 1, d], signed sin [T, 1, d]) for ``apply_rotary``, once per forward pass.

        The sin's first half is negated so that rotate-half becomes a roll:
        ``rotate_half(x) * sin == roll(x, d/2) * signed_sin`` exactly. Values come from a table
        of the same computation over positions 0..n (grown by doubling), so each pass costs two
        gathers; the table is bit-identical to computing the positions directly.
        """
        table = self._tables.get(dtype)
        if max_position is None:                 # known on the host when the caller built positions
            max_position = int(positions.max()) if positions.numel() else 0
        need = max_position + 1
        if table is None or table[0].shape[0] < need:
            n = max(need, 2 * table[0].shape[0] if table is not None else 4096)
            table = self._tables[dtype] = self._compute(torch.arange(n, device=self.inv_freq.device), dtype)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos / signed_sin [T, 1, r] from ``Rotary.cos_sin``: the first r of the d
    dimensions rotate (r < d: a partial rotary embedding), the rest pass unchanged."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :r], cos, signed_sin), x[..., r:]), dim=-1)
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def tempering(cfg: ModelConfig, layer: int) -> tuple[float, float, float] | None:
    """``(floor_scale, scale, offset)`` of ``layer``'s query temperature, each query times
    ``log1p(floor((position + offset) / floor_scale)) * scale + 1``: Llama 4's on its layers without
    rotary (offset 1), Mistral 4's on every layer (offset 0); None: none."""
    if cfg.position_temperature is not None:
        return (*cfg.position_temperature, 0.0)
    if cfg.attn_temperature is not None and layer in cfg.nope_layers:
        return (*cfg.attn_temperature, 1.0)
    return None


def temper_factor(temper: tuple[float, float, float], positions: torch.Tensor) -> torch.Tensor:
    """``[T]`` float32 factors of ``tempering``'s temperature at ``positions``."""
    floor_scale, scale, offset = temper
    return torch.log1p(torch.floor((positions.float() + offset) / floor_scale)) * scale + 1.0
