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

Prompt chunks attend in the expanded form instead (``expand_prompts``): each chunk up-projects
its context's latents to every head's keys and values, so a pair of query and key costs
``nope + rope + v`` (320) multiply-adds instead of ``2 kv_rank + rope`` (1,088), and the
up-projection, once per key and chunk, is shared by the chunk's queries. Decode tokens in the
same pass, and decode steps, stay on the latent.

The checkpoint's rotary dimensions are interleaved pairs (DeepSeek's layout, ``rope_interleave``):
the rows that make ``q_pe`` and ``k_pe`` are permuted to rotate-half order once at load, which
leaves every score unchanged (the same permutation on both sides of each dot product).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .attention import Attention, gpu_sdpa
from .batch import AttnBatch
from .linear import linear
from .norm import RMSNorm
from .rope import Rotary, apply_rotary, temper_factor, tempering


def halves_order(rope_dim: int) -> torch.Tensor:
    """The permutation taking interleaved rotary pairs (x0, x1), (x2, x3)... to rotate-half order
    (x0, x2, ..., x1, x3, ...)."""
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


class LatentAttention(Attention):
    #: prompt chunks attend in the expanded form; False: on the latent, as decode steps do (the
    #: engine of stop 53's first commits; bench/latent_attention_prefill.py's A/B)
    expand_prompts = True

    def __init__(self, cfg: ModelConfig, layer: int, rotary: Rotary):
        nn.Module.__init__(self)
        a = cfg.mla
        self.mla = a
        self.h, self.kvh, self.d = cfg.num_heads, 1, a.cache_dim
        self.gated, self.gate_proj, self.qk_norm, self.clip, self.sinks = False, None, "none", None, None
        self.window = cfg.sliding_window[layer] if cfg.sliding_window else None
        self.chunk, self.temper = None, tempering(cfg, layer)
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

    def _parts(self, x: torch.Tensor):
        """``x``'s projections, none rotated: q_nope ``[T, h, nope]``, q_pe ``[T, h, rope]``, its key
        row ``[T, rope + kv_rank]`` (``[k_pe, norm(c)]``)."""
        a, t = self.mla, x.shape[0]
        q = self.q_proj(x) if a.q_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.h, a.nope_dim + a.rope_dim).split([a.nope_dim, a.rope_dim], -1)
        c, k_pe = linear(x, self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias).split(
            [a.kv_rank, a.rope_dim], -1)
        return q_nope, q_pe, torch.cat((k_pe, self.kv_a_layernorm(c)), -1)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``[T, (h + 2) d]``: each head's query ``[q_pe, W_UK^T q_nope]``, then the key row twice
        (as key and as value)."""
        t = k.shape[0]
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.qkv[0]).transpose(0, 1)          # [T, h, kv_rank]
        return torch.cat((torch.cat((q_pe, q_lat), -1).reshape(t, self.h * self.d), k, k), -1)

    def _fused_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, (h + 2) d]`` of ``x`` (``_absorbed``), none rotated yet."""
        return self._absorbed(*self._parts(x))

    def forward(self, x: torch.Tensor, batch: AttnBatch, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """A pass with prompt chunks: the chunks in the expanded form, its decode tokens through the
        fused decode kernel on the latent; any other pass (or one whose decode tokens have no
        fused kernel here) as ``Attention`` runs it, on the latent."""
        per_chunk = self.by_sequence and batch.q_max > 1 and batch.seq_counts is not None
        singles = batch.singles() if per_chunk else None
        impl = self._decode_kernel(x, k_cache) if singles is not None else None
        if not (self.expand_prompts and per_chunk and (singles is None or impl is not None)):
            return super().forward(x, batch, cos, sin, k_cache, v_cache)
        a = self.mla
        q_nope, q_pe, k = self._parts(x)
        if self.temper is not None:            # Mistral 4: every query scaled by its position
            f = temper_factor(self.temper, batch.positions)[:, None, None]
            q_nope, q_pe = (q_nope * f).to(q_nope.dtype), (q_pe * f).to(q_pe.dtype)
        out = x.new_empty((x.shape[0], self.h, a.v_dim))
        if singles is not None:               # one token each: decode steps, on the latent
            sel, rows, width, ends = singles
            lat = self._decode(impl, self._absorbed(*(z.index_select(0, rows) for z in (q_nope, q_pe, k))),
                               cos.index_select(0, rows), sin.index_select(0, rows), k_cache, v_cache,
                               batch.slot_mapping.index_select(0, rows),
                               batch.kv_index.index_select(0, sel)[:, :width].contiguous(), ends, batch.write_first)
            out.index_copy_(0, rows, self._up(lat))
        keep = batch.chunk_rows()
        c, s = cos.index_select(0, keep), sin.index_select(0, keep)
        q_nope, q_pe, k = (z.index_select(0, keep) for z in (q_nope, q_pe, k))
        q_pe = apply_rotary(q_pe, c, s)
        k = torch.cat((apply_rotary(k[:, None, :a.rope_dim], c, s)[:, 0], k[:, a.rope_dim:]), -1)
        slots = batch.slot_mapping.index_select(0, keep)
        v_cache.index_copy_(0, slots, k[:, None])             # V first: it may be K (cache/kv.py)
        k_cache.index_copy_(0, slots, k[:, None])
        got = self._expanded_chunks(torch.cat((q_nope, q_pe), -1), k_cache, batch)
        out.index_copy_(0, keep, got)
        return self.o_proj(out.reshape(x.shape[0], self.h * a.v_dim))

    def _expanded_chunks(self, q: torch.Tensor, k_cache: torch.Tensor, batch: AttnBatch) -> torch.Tensor:
        """Each multi-token chunk's attention over its own context, expanded: ``q [rows, h, nope +
        rope]`` (rotated) of the chunks' rows in order -> ``[rows, h, v]``."""
        a, out = self.mla, []
        gpu, lower_right = q.device.type == "cuda", self._lower_right(q)
        for i, row, n, lo, end in self._chunk_spans(batch, singles_in_rows=False):
            keys = k_cache.index_select(0, batch.kv_index[i, lo:end])[:, 0]               # [L, rope + kv_rank]
            lat = keys[None, :, a.rope_dim:]
            k = torch.cat((torch.matmul(lat, self.qkv[0].transpose(1, 2)),                 # [h, L, nope]
                           keys[None, :, :a.rope_dim].expand(self.h, -1, -1)), -1)
            v = torch.matmul(lat, self.qkv[1])                                            # [h, L, v]
            qc = q[row:row + n].transpose(0, 1)[None]                                     # [1, h, n, nope + rope]
            wide = k.shape[-1] - v.shape[-1]
            # one head size for all three (zeros added: the same scores and sums): SDPA's fused CPU
            # kernel took 2.1x as long with narrower values (h 16, 512 x 8192), flash refuses them
            if wide > 0:
                v = F.pad(v, (0, wide))
            elif wide < 0:
                k, qc = F.pad(k, (0, -wide)), F.pad(qc, (0, -wide))
            mask = None if lower_right else self._chunk_mask(n, lo, end, q.device)
            got = gpu_sdpa(qc, k[None], v[None], mask, lower_right, self.scale) if gpu else \
                F.scaled_dot_product_attention(qc, k[None], v[None], attn_mask=mask, scale=self.scale)
            out.append(got[0, ..., :a.v_dim].transpose(0, 1))
        return torch.cat(out)

    def _up(self, o: torch.Tensor) -> torch.Tensor:
        """``o [T, h d]`` on the latent -> each head's value ``[T, h, v]`` (W_UV of its latent sum)."""
        t = o.shape[0]
        lat = o.view(t, self.h, self.d)[..., self.mla.rope_dim:].transpose(0, 1)        # [h, T, kv_rank]
        return torch.bmm(lat, self.qkv[1]).transpose(0, 1)

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``o [T, h d]``: each head's latent sum (its last ``kv_rank`` dimensions) through W_UV,
        then ``o_proj``."""
        return self.o_proj(self._up(o).reshape(o.shape[0], self.h * self.mla.v_dim))
