"""Grouped-query attention over a paged KV pool.

The KV pool is a flat array of token slots per layer (``cache/kv.py``); a sequence's tokens
live in fixed-size blocks named by its block table. ``AttnBatch`` (``layers/batch.py``, built by
the executor for one forward pass) says where each new token's K/V goes and which slots each
sequence reads.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..config import ModelConfig
from ..kernels import gpu_decode_kernels
from ..kernels.cpu import attention as cpu_attention
from . import sinks as attention_sinks
from .batch import AttnBatch
from .linear import linear
from .norm import L2Norm, RMSNorm
from .rope import Rotary, apply_rotary, temper_factor, tempering


#: the backends a GPU's general attention path may take: not cuDNN's, the default on SM 9.0+ since
#: torch 2.11, whose masked forward gave wrong rows on the H200 (device run 120: batched prefill
#: chunks of different lengths; pytorch issues 162588, 196678 name masked cuDNN SDPA bugs)
GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def flash_takes_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether flash attention computes ``q [B, h, Q, d]`` over ``k`` / ``v [B, kvh, L, d]`` with
    their grouped heads as they are (half-precision data on a GPU that has it). Asked without the
    causal flag, as torch's lower-right causal call asks: the flag means the upper-left triangle,
    which flash refuses for a chunk with more keys than queries."""
    return can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True), False)


def reads_grouped_heads(device: torch.device, dtype: torch.dtype, cfg: ModelConfig) -> bool:
    """Whether a prompt chunk's attention on ``device`` reads the grouped KV heads in place
    (``Attention._attend``: flash attention takes them) rather than repeated to every query head:
    the same check on empty tensors of the model's shapes, for what the memory budget reserves."""
    if device.type != "cuda" or cfg.num_heads == cfg.num_kv_heads or not Attention.grouped_flash:
        return False
    q = torch.empty(1, cfg.num_heads, 1, cfg.head_dim, device=device, dtype=dtype)
    k = torch.empty(1, cfg.num_kv_heads, 1, cfg.head_dim, device=device, dtype=dtype)
    return flash_takes_groups(q, k, k)


def gpu_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             lower_right: bool, scale: float, grouped: bool = False) -> torch.Tensor:
    """SDPA on a GPU (heads already repeated, or ``grouped``: flash attention reads KV head
    i // g for query head i). ``lower_right``: a prompt's chunk of one sequence
    (``AttnBatch.aligned``, no sliding window) as the lower-right causal triangle, which flash
    attention computes without a mask tensor (an 8192-token chunk at 40k context would hold a
    0.7 GB one); else the boolean ``mask`` (or none), never through cuDNN's kernel."""
    if lower_right:
        mask = causal_lower_right(q.shape[2], k.shape[2])
    with sdpa_kernel(GPU_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=grouped)


class Attention(nn.Module):
    #: the general path through ``scaled_dot_product_attention``; False: grouped matmuls that hold
    #: the [Q, L] scores whole (the engine before 2026-12-01; bench/cpu_prefill_attention.py's A/B)
    sdpa = True
    #: a pass with a multi-token chunk attends per chunk (``_by_sequence``); False: every sequence
    #: padded to the longest chunk and context (the engine before 2026-12-01's twenty-fourth
    #: session; bench/mixed_pass_attention.py's A/B)
    by_sequence = True
    #: a GPU chunk's flash call reads the grouped KV heads in place; False: repeated to every query
    #: head first (the engine before 2026-12-01's twenty-fifth session; bench/engine_gpu_prefill.py's A/B)
    grouped_flash = True

    def __init__(self, cfg: ModelConfig, layer: int, rotary: Rotary):
        super().__init__()
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.h, self.kvh, self.d = h, kvh, d
        # a gated attention's q_proj also yields, per head, the gate of its output (Qwen3-Next)
        self.gated = cfg.attn_gate
        self.q_proj = nn.Linear(cfg.hidden_size, h * d * (2 if self.gated else 1), bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        # ... or a projection of its own does (afmoe)
        self.gate_proj = nn.Linear(cfg.hidden_size, h * d, bias=False) if cfg.gate_proj else None
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "l2":             # Llama 4: weightless, after the rotary, rotary layers only
            self.qk_norm = "none" if layer in cfg.nope_layers else "rotated"
            if self.qk_norm == "rotated":
                self.q_norm = self.k_norm = L2Norm(cfg.rms_norm_eps)
        elif cfg.qk_norm in ("head", "rotated"):
            self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(h * d, cfg.rms_norm_eps), RMSNorm(kvh * d, cfg.rms_norm_eps)
        self.clip = cfg.clip_qkv
        self.window = cfg.sliding_window[layer] if cfg.sliding_window else None
        self.chunk = cfg.attention_chunks[layer] if cfg.attention_chunks else None
        self.temper = tempering(cfg, layer)
        self.rotary = rotary
        self.scale = cfg.attention_multiplier or d ** -0.5
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.gate: tuple[torch.Tensor, torch.Tensor | None] | None = None
        # attention sinks: a logit per query head in the softmax's denominator only
        self.sinks = nn.Parameter(torch.zeros(h)) if cfg.attn_sinks else None

    def fuse(self) -> None:
        """After loading: one [q; k; v] matmul instead of three (fewer ops per decode step); a
        gated attention's gate rows (interleaved per head with q's) become a projection of their own."""
        with torch.no_grad():
            qw, qb = self.q_proj.weight, self.q_proj.bias
            if self.gated:
                rows = qw.view(self.h, 2, self.d, -1)
                qw, self.gate = rows[:, 0].reshape(self.h * self.d, -1), (rows[:, 1].reshape(self.h * self.d, -1), None)
                if qb is not None:
                    bias = qb.view(self.h, 2, self.d)
                    qb, self.gate = bias[:, 0].reshape(-1), (self.gate[0], bias[:, 1].reshape(-1))
            w = torch.cat([qw, self.k_proj.weight, self.v_proj.weight])
            b = torch.cat([qb, self.k_proj.bias, self.v_proj.bias]) if qb is not None else None
        self.qkv = (w, b)
        if self.gate_proj is not None:
            self.gate = (self.gate_proj.weight, None)
        del self.q_proj, self.k_proj, self.v_proj, self.gate_proj

    def _fused_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, (h + 2 kvh) d]``: the fused projection's q, k and v of ``x`` (after ``fuse``),
        before norms and rotary."""
        return linear(x, *self.qkv)

    def _tempered(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Llama 4's temperature on a layer without rotary, Mistral 4's on every layer
        (``tempering``): the queries of ``q`` (``[T, h, d]``, or the first h d columns of a fused
        ``[T, (h + 2 kvh) d]``) times a factor of each position."""
        if self.temper is None:
            return q
        f = temper_factor(self.temper, positions)
        if q.dim() == 3:
            return (q * f[:, None, None]).to(q.dtype)
        n = self.h * self.d
        return torch.cat(((q[:, :n] * f[:, None]).to(q.dtype), q[:, n:]), -1)

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The output projection of the heads' output ``o [T, h d]`` (gated by ``x``'s gate)."""
        if self.gate is not None:
            o = o * torch.sigmoid(linear(x, *self.gate))
        return self.o_proj(o)

    def forward(self, x: torch.Tensor, batch: AttnBatch, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        if self.qkv is None and (self.gated or self.gate_proj is not None):
            self.fuse()                    # the gate comes out of q_proj's rows, or gate_proj
        if batch.q_max == 1 and batch.kv_len is not None:
            impl = self._decode_kernel(x, k_cache)
            if impl is not None:
                # Decode: norm, rotary, K/V write and attention in one compiled call on the CPU,
                # in two Triton launches on a GPU.
                return self._out(self._decode(impl, self._tempered(self._fused_qkv(x), batch.positions), cos, sin,
                                              k_cache, v_cache, batch.slot_mapping, batch.kv_index, batch.kv_len,
                                              batch.write_first), x)
        t = x.shape[0]
        per_chunk = self.by_sequence and batch.q_max > 1 and batch.seq_counts is not None
        if per_chunk and batch.singles() is not None:
            impl = self._decode_kernel(x, k_cache)
            if impl is not None:
                return self._out(self._beside_chunks(impl, x, batch, cos, sin, k_cache, v_cache), x)
        q, k, v = self._project(x, None, cos, sin)
        q = self._tempered(q, batch.positions)
        v_cache.index_copy_(0, batch.slot_mapping, v)     # write new K/V (V first: it may be K, cache/kv.py)
        k_cache.index_copy_(0, batch.slot_mapping, k)
        if per_chunk:
            return self._out(self._by_sequence(q, k_cache, v_cache, batch).reshape(t, self.h * self.d), x)
        b, lmax = batch.kv_index.shape
        keys, values = self._keys(k_cache, v_cache, batch.kv_index)                     # [B, kvh, L, d]
        if batch.q_max == 1:       # pure decode: token b is sequence b, no padding to undo
            qp = q.view(b, 1, self.h, self.d)
        else:
            qp = q.new_zeros((b * batch.q_max, self.h, self.d)).index_copy(0, batch.q_flat, q)
            qp = qp.view(b, batch.q_max, self.h, self.d)
        qp = qp.transpose(1, 2)                                                        # [B, h, Q, d]
        lower_right = batch.aligned and self._lower_right(x)
        spans = self.window is not None or self.chunk is not None
        mask = batch.mask(self.window, self.chunk) if (batch.needs_mask or spans) and not lower_right else None
        if batch.needs_mask and not batch.aligned:   # padding reads slot 0, whoever holds it: a NaN
            keys, values = keys.masked_fill(batch.padding(), 0.0), values.masked_fill(batch.padding(), 0.0)
        out = self._attend(qp, keys, values, mask, lower_right)
        out = out.transpose(1, 2).reshape(b * batch.q_max, self.h, self.d)
        if batch.q_max > 1:
            out = out.index_select(0, batch.q_flat)
        return self._out(out.reshape(t, self.h * self.d), x)

    def _project(self, x: torch.Tensor, qkv: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor):
        """q [T, h, d], k / v [T, kvh, d] of ``x`` (or of its fused projection ``qkv``): projected,
        normed, clipped and rotated as the model does."""
        t = x.shape[0] if qkv is None else qkv.shape[0]
        if qkv is None and self.qkv is not None:
            qkv = self._fused_qkv(x)
        if qkv is not None:
            q, k, v = qkv.split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)      # [T, h*d], [T, kvh*d] x2
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (z.clamp(-self.clip, self.clip) for z in (q, k, v))
        q, k, v = q.view(t, self.h, self.d), k.view(t, self.kvh, self.d), v.view(t, self.kvh, self.d)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(torch.cat((q, k), dim=1), cos, sin).split([self.h, self.kvh], dim=1)
        if self.qk_norm == "rotated":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _decode_kernel(self, x: torch.Tensor, k_cache: torch.Tensor):
        """The fused decode attention (kernels/triton/attention.py on a GPU, kernels/cpu/attention.py
        on the CPU) when it takes this layer and these tensors, else None."""
        if self.qkv is None or self.clip is not None:
            return None
        gpu = gpu_decode_kernels("attention") if x.device.type == "cuda" else None
        if gpu is not None and gpu.supported(x, k_cache, self.d):
            return gpu
        return cpu_attention if cpu_attention.supported(x, k_cache) else None

    def _decode(self, impl, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slots: torch.Tensor, kv_index: torch.Tensor, kv_len: torch.Tensor,
                write_first: bool = False) -> torch.Tensor:
        """One token per sequence through ``impl``'s fused kernel: ``qkv [B, (h + 2 kvh) d]`` ->
        ``[B, h d]``, its K/V written at ``slots``; the keys read in the paged pool, none gathered.
        q/k norms over the whole projection (OLMoE, MiniMax-M2) are applied here first, the
        kernel's own per-head norm then left off; per-head norms after the rotary (Hunyuan) run
        here with the rotary, the kernel then rotating by the identity (cos 1, sin 0: exact)."""
        head = self.qk_norm == "head"
        if self.qk_norm in ("full", "rotated"):
            q, k, v = qkv.split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], -1)
            if self.qk_norm == "full":
                q, k = self.q_norm(q), self.k_norm(k)
            else:
                b = qkv.shape[0]
                q, k = apply_rotary(torch.cat((q.view(b, self.h, self.d), k.view(b, self.kvh, self.d)), 1), cos,
                                    sin).split([self.h, self.kvh], 1)
                q, k = self.q_norm(q).reshape(b, -1), self.k_norm(k).reshape(b, -1)
                cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
            qkv = torch.cat((q, k, v), -1)
        return impl.decode_attention(qkv, self.h, self.kvh, self.d, self.q_norm.weight if head else None,
                                     self.k_norm.weight if head else None, self.q_norm.eps if head else 0.0,
                                     cos, sin, k_cache, v_cache, slots, kv_index, kv_len, self.window, self.scale,
                                     write_first, sinks=self.sinks, chunk=self.chunk)

    def _beside_chunks(self, impl, x: torch.Tensor, batch: AttnBatch, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """A pass of decode tokens beside prompts' chunks: the decode tokens through the fused
        decode kernel, as in a decode step (no key gathered: 31 decoding requests at 40k context
        would gather 2.6 GB of bf16 keys and values), the chunks one at a time
        (``_by_sequence``). Returns ``[T, h d]`` in row order."""
        sel, rows, width, ends = batch.singles()
        keep = batch.chunk_rows()
        qkv = self._tempered(self._fused_qkv(x), batch.positions)
        out = qkv.new_empty((x.shape[0], self.h * self.d))
        out.index_copy_(0, rows, self._decode(
            impl, qkv.index_select(0, rows), cos.index_select(0, rows), sin.index_select(0, rows), k_cache,
            v_cache, batch.slot_mapping.index_select(0, rows), batch.kv_index.index_select(0, sel)[:, :width].contiguous(),
            ends, batch.write_first))
        q, k, v = self._project(x, qkv.index_select(0, keep), cos.index_select(0, keep), sin.index_select(0, keep))
        slots = batch.slot_mapping.index_select(0, keep)
        v_cache.index_copy_(0, slots, v)
        k_cache.index_copy_(0, slots, k)
        got = torch.empty_like(q)
        self._chunks(q, k_cache, v_cache, batch, got, singles_in_rows=False)
        out.index_copy_(0, keep, got.reshape(-1, self.h * self.d))
        return out

    def _keys(self, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_index: torch.Tensor):
        """The keys and values of ``kv_index [B, L]``'s slots: ``[B, kvh, L, d]`` each."""
        b, length = kv_index.shape
        flat = kv_index.reshape(-1)                # index_select: advanced indexing is ~100x slower
        keys = k_cache.index_select(0, flat).view(b, length, self.kvh, self.d).transpose(1, 2)
        return keys, v_cache.index_select(0, flat).view(b, length, self.kvh, self.d).transpose(1, 2)

    def _attend(self, qp: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                lower_right: bool = False) -> torch.Tensor:
        """qp [B, h, Q, d] over keys / values [B, kvh, L, d] -> [B, h, Q, d]. Query head i reads KV
        head i // g. Fused (flash-style) kernels, so the [Q, L] scores of a long prefill chunk are
        never held whole. On a GPU a chunk's lower-right causal call reads the grouped heads in
        place through flash attention; elsewhere the KV heads are repeated, since the kernel that
        takes a mask (or float32 data) there takes no grouped heads: 0.34 GB each for keys and
        values of Qwen3-30B at a 40k context."""
        g = self.h // self.kvh
        if self.sinks is not None:
            return attention_sinks.attend(self, qp, keys, values, mask, lower_right)
        if not self.sdpa:
            return self._grouped_matmuls(qp, keys, values, mask)
        if qp.device.type == "cuda":
            grouped = g > 1 and lower_right and self.grouped_flash and flash_takes_groups(qp, keys, values)
            if g > 1 and not grouped:
                keys, values = keys.repeat_interleave(g, dim=1), values.repeat_interleave(g, dim=1)
            return gpu_sdpa(qp, keys, values, mask, lower_right, self.scale, grouped)
        return F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=g > 1)

    def _allowed(self, qpos: torch.Tensor, keys: int) -> torch.Tensor:
        """[.., Q, keys] bool: the keys each query position of ``qpos [.., Q]`` may see (causal,
        and within the sliding window)."""
        kpos = torch.arange(keys, device=qpos.device)
        m = kpos <= qpos[..., None]
        if self.window is not None:
            m &= kpos > qpos[..., None] - self.window
        if self.chunk is not None:
            m &= kpos >= qpos[..., None] - qpos[..., None] % self.chunk
        return m

    def _by_sequence(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: AttnBatch) -> torch.Tensor:
        """A pass with a multi-token chunk (a prompt's, alone, beside other prompts' or beside
        decode tokens): each chunk attends alone over its own keys (from the first its sliding
        window reaches), and the single tokens together, so nothing is padded to the longest
        chunk or the longest context.
        The padded layout held B x Qmax query rows and B x Lmax keys (repeated to every head on a
        GPU): for a 512-token chunk beside 31 decoding requests, 32 x 512 rows for 543 real ones.
        Returns ``[T, h, d]`` in row order; the same arithmetic per row as a pass of one sequence."""
        out = torch.empty_like(q)
        self._chunks(q, k_cache, v_cache, batch, out, singles_in_rows=True)
        singles = batch.singles()
        if singles is not None:   # one token each: [B1, h, L] scores at most, so no head is repeated
            sel, rows, width, ends = singles
            keys, values = self._keys(k_cache, v_cache, batch.kv_index.index_select(0, sel)[:, :width])
            # a token's padding lies past its end, so the causal mask hides it (a NaN key's score
            # too); its values are zeroed, since 0 * NaN is NaN
            values = values.masked_fill(~batch.kv_valid.index_select(0, sel)[:, None, :width, None], 0.0)
            got = self._one_token(q.index_select(0, rows), keys, values, self._allowed(ends - 1, width))
            out.index_copy_(0, rows, got)
        return out

    def _chunks(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                out: torch.Tensor, singles_in_rows: bool) -> None:
        """Each multi-token chunk's attention, alone, into its rows of ``out``; ``q`` and ``out``
        hold every row of the pass (``singles_in_rows``) or only the chunks' rows."""
        lower_right = self._lower_right(q)
        for i, row, n, lo, end in self._chunk_spans(batch, singles_in_rows):
            keys, values = self._keys(k_cache, v_cache, batch.kv_index[i:i + 1, lo:end])
            qp = q[row:row + n].transpose(0, 1)[None]                                   # [1, h, n, d]
            mask = None if lower_right else self._chunk_mask(n, lo, end, q.device)
            out[row:row + n] = self._attend(qp, keys, values, mask, lower_right)[0].transpose(0, 1)

    def _lower_right(self, q: torch.Tensor) -> bool:
        """Whether a chunk's causal mask is the lower-right triangle, which a GPU's SDPA computes
        without a mask tensor (no sliding window)."""
        return self.sdpa and q.device.type == "cuda" and self.window is None and self.chunk is None

    def _chunk_spans(self, batch: AttnBatch, singles_in_rows: bool):
        """(sequence, first row, tokens, first key, keys) of each multi-token chunk of the pass: its
        keys from the first its sliding window reaches; rows counted over every row of the pass
        (``singles_in_rows``) or over the chunks' rows only."""
        row = 0
        for i, (n, end) in enumerate(zip(batch.seq_counts, batch.seq_ends)):
            if n > 1:
                first = end - n                 # the first query's position: keys before its reach are left out
                lo = max(0, first - self.window + 1) if self.window is not None else 0
                yield i, row, n, max(lo, first - first % self.chunk) if self.chunk is not None else lo, end
            if n > 1 or singles_in_rows:
                row += n

    def _chunk_mask(self, n: int, lo: int, end: int, device: torch.device) -> torch.Tensor:
        """[1, 1, n, end - lo] bool: the keys from ``lo`` each of a chunk's n queries may see."""
        return self._allowed(torch.arange(end - n - lo, end - lo, device=device), end - lo)[None, None]

    def _one_token(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   allowed: torch.Tensor) -> torch.Tensor:
        """One query token per sequence: ``q [B, h, d]`` over ``keys`` / ``values [B, kvh, L, d]``
        where ``allowed [B, L]`` -> ``[B, h, d]``. A KV head's g query heads are the rows of one
        matmul, so no key is repeated or broadcast; float32 softmax over [B, h, L] scores."""
        b, g = q.shape[0], self.h // self.kvh
        scores = torch.matmul(q.view(b, self.kvh, g, self.d), keys.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))          # [B, kvh, g, L]
        probs = self._softmax(scores, (1, self.kvh, g, 1)).to(q.dtype)
        return torch.matmul(probs, values).view(b, self.h, self.d)

    def _grouped_matmuls(self, qp: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         mask: torch.Tensor | None) -> torch.Tensor:
        """The same attention as SDPA, with the float32 scores [B, kvh, g, Q, L] held whole."""
        b, _, q_max, _ = qp.shape
        g = self.h // self.kvh
        qg = qp.reshape(b, self.kvh, g, q_max, self.d)
        scores = torch.matmul(qg, keys.unsqueeze(2).transpose(-1, -2)) * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
        probs = self._softmax(scores, (1, self.kvh, g, 1, 1)).to(qp.dtype)
        return torch.matmul(probs, values.unsqueeze(2)).view(b, self.h, q_max, self.d)

    def _softmax(self, scores: torch.Tensor, heads: tuple[int, ...]) -> torch.Tensor:
        """float32 softmax over the last dimension, each query head's sink (viewed as ``heads``)
        in the denominator when the layer has sinks."""
        if self.sinks is None:
            return torch.softmax(scores, dim=-1, dtype=torch.float32)
        return attention_sinks.softmax(scores, self.sinks.float().view(heads))
