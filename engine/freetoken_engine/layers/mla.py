"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash), run on the latent.

The checkpoint's attention projects each token to a latent ``c`` (``kv_rank`` wide, normed) and
one rotated key ``k_pe`` (``rope_dim``) shared by every head; head i's key is
``[W_UK[i] c, k_pe]`` and its value ``W_UV[i] c`` (``kv_b_proj``'s rows). transformers expands
both per head; the engine keeps only ``[k_pe, c]`` per token and moves the up-projections to the
other side of the attention, exactly:

    q_nope . (W_UK[i] c) = (W_UK[i]^T q_nope) . c           (the query "absorbs" W_UK)
    sum_j p_j W_UV[i] c_j = W_UV[i] (sum_j p_j c_j)          (the output absorbs W_UV)

so a layer's attention is grouped-query attention with one KV head of ``rope_dim + kv_rank``
dimensions whose first ``rope_dim`` rotate: the paged KV pool, the fused decode kernels and the
prompt paths of ``Attention`` run it unchanged, each head's query ``[q_pe, W_UK^T q_nope]`` and
its output's last ``kv_rank`` dimensions the latent sum that ``W_UV`` takes up. A token costs
``rope_dim + kv_rank`` cached values per layer (the pool's values are its keys, one tensor:
``cache/kv.py`` ``shared_values``; the value rows' rotated part is never used) where the expanded
form costs ``heads x (nope + rope + v)``: DeepSeek-V3's 576 against 40,960, DeepSeek-V2-Lite's
576 against 5,120.

The checkpoint's rotary dimensions are interleaved pairs (DeepSeek's layout, ``rope_interleave``):
the rows that make ``q_pe`` and ``k_pe`` are permuted to rotate-half order once at load, which
leaves every score unchanged (the same permutation on both sides of each dot product).
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .attention import Attention
from .linear import linear
from .norm import RMSNorm
from .rope import Rotary


def halves_order(rope_dim: int) -> torch.Tensor:
    """The permutation taking interleaved rotary pairs (x0, x1), (x2, x3)... to rotate-half order
    (x0, x2, ..., x1, x3, ...)."""
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


class LatentAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: Rotary):
        nn.Module.__init__(self)
        a = cfg.mla
        self.mla = a
        self.h, self.kvh, self.d = cfg.num_heads, 1, a.cache_dim
        self.gated, self.gate_proj, self.qk_norm, self.clip = False, None, "none", None
        self.window = cfg.sliding_window[layer] if cfg.sliding_window else None
        self.rotary = rotary
        self.scale = cfg.rope.softmax_scale(a.nope_dim + a.rope_dim)
        self.gate = None
        hidden, q_dim = cfg.hidden_size, cfg.num_heads * (a.nope_dim + a.rope_dim)
        if a.q_rank is None:
            self.q_proj = nn.Linear(hidden, q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, a.q_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(a.q_rank, 1e-6)
            self.q_b_proj = nn.Linear(a.q_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, a.kv_rank + a.rope_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(a.kv_rank, 1e-6)
        self.kv_b_proj = nn.Linear(a.kv_rank, cfg.num_heads * (a.nope_dim + a.v_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * a.v_dim, hidden, bias=cfg.o_bias)
        self.qkv = None                 # (W_UK [h, nope, kv_rank], W_UV^T [h, kv_rank, v]) once fused

    def fuse(self) -> None:
        """After loading: the up-projections split per head for the absorbed form, and the
        rotary rows of an interleaved checkpoint put in rotate-half order."""
        a, h = self.mla, self.h
        with torch.no_grad():
            if a.interleaved:
                order = halves_order(a.rope_dim).to(self.kv_b_proj.weight.device)
                q = self.q_proj if a.q_rank is None else self.q_b_proj
                rows = q.weight.view(h, a.nope_dim + a.rope_dim, -1)
                rows[:, a.nope_dim:] = rows[:, a.nope_dim:].index_select(1, order)
                kv = self.kv_a_proj_with_mqa
                kv.weight[a.kv_rank:] = kv.weight[a.kv_rank:].index_select(0, order)
                if kv.bias is not None:
                    kv.bias[a.kv_rank:] = kv.bias[a.kv_rank:].index_select(0, order)
            up = self.kv_b_proj.weight.view(h, a.nope_dim + a.v_dim, a.kv_rank)
            self.qkv = (up[:, :a.nope_dim].contiguous(), up[:, a.nope_dim:].transpose(1, 2).contiguous())
        del self.kv_b_proj

    def _fused_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, (h + 2) d]``: each head's query ``[q_pe, W_UK^T q_nope]``, then the token's key
        ``[k_pe, norm(c)]`` twice (as key and as value), none rotated yet."""
        a, h, t = self.mla, self.h, x.shape[0]
        q = self.q_proj(x) if a.q_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, h, a.nope_dim + a.rope_dim).split([a.nope_dim, a.rope_dim], -1)
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.qkv[0]).transpose(0, 1)          # [T, h, kv_rank]
        c, k_pe = linear(x, self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias).split(
            [a.kv_rank, a.rope_dim], -1)
        k = torch.cat((k_pe, self.kv_a_layernorm(c)), -1)
        return torch.cat((torch.cat((q_pe, q_lat), -1).reshape(t, h * self.d), k, k), -1)

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``o [T, h d]``: each head's latent sum (its last ``kv_rank`` dimensions) through W_UV,
        then ``o_proj``."""
        t, a = o.shape[0], self.mla
        lat = o.view(t, self.h, self.d)[..., a.rope_dim:].transpose(0, 1)                # [h, T, kv_rank]
        return self.o_proj(torch.bmm(lat, self.qkv[1]).transpose(0, 1).reshape(t, self.h * a.v_dim))
