"""The decoder-only transformer that every supported family composes.

Module names mirror the Hugging Face layout (``model.layers.{i}.self_attn.q_proj`` ...) so a
checkpoint's non-expert tensors load by name; routed experts live in the expert bank instead.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.attention import Attention
from ..layers.batch import AttnBatch
from ..layers.deltanet import GatedDeltaNet
from ..layers.mlp import GatedMLP
from ..layers.moe import SparseMoE
from ..layers.norm import RMSNorm
from ..layers.rope import Rotary


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, rotary: Rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if i in cfg.linear_layers:           # a hybrid model's Gated DeltaNet layer: no KV
            self.self_attn = None
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear, cfg.linear_layers.index(i), cfg.rms_norm_eps)
        else:
            self.self_attn = Attention(cfg, i, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if i in cfg.moe_layers:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.moe_layers.index(i))
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)

    def forward(self, h, batch, cos, sin, k_cache, v_cache):
        x = self.input_layernorm(h)
        a = self.linear_attn(x, batch) if self.self_attn is None else self.self_attn(x, batch, cos, sin, k_cache, v_cache)
        h, x = self.post_attention_layernorm.add_forward(a, h)           # h + a and its norm
        return self.mlp(x, residual=h)                                   # h + mlp(x)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    """``forward(ids [T], batch, kv, logits_at [B]) -> logits [B, V]`` (float32)."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary):
        super().__init__()
        self.cfg = cfg
        self.rotary = rotary
        self.model = Backbone(cfg, rotary)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        kv_of = {layer: j for j, layer in enumerate(cfg.attention_layers)}
        self.kv_of = [kv_of.get(i) for i in range(cfg.num_layers)]     # each layer's KV pool layer (None: none)

    def moe_blocks(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)]

    def deltanets(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.self_attn is None]

    def forward(self, ids: torch.Tensor, batch: AttnBatch, kv, logits_at: torch.Tensor,
                between: Callable[[int], None] | None = None) -> torch.Tensor:
        """``between(i)``, when given, is called after layer i's work is queued, for every layer
        but the last (the scheduler runs other sequences' decode steps there)."""
        h = self.model.embed_tokens(ids)                                  # [T, H]
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype, batch.max_position)   # [T, 1, d]
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            j = self.kv_of[i]
            h = layer(h, batch, cos, sin, kv.k[j] if j is not None else None, kv.v[j] if j is not None else None)
            if between is not None and i < last:
                between(i)
        if h.shape[0] != logits_at.shape[0]:                              # keep each sequence's last row
            h = h.index_select(0, logits_at)
        logits = self.lm_head(self.model.norm(h))                         # [B, V]
        return logits if logits.dtype == torch.float32 else logits.float()
