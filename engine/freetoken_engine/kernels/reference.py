"""Readable PyTorch reference for every expert kernel: the CPU path, the CI path and the spec.

An MoE layer's routed work is a list of (token, expert) *pairs*. Each pair's output is

    y[p] = W2[e] @ (silu(W1[e] @ x[t]) * (W3[e] @ x[t]))      t = pair_tok[p], e = pair_exp[p]

with the gate (W1) and up (W3) projections stored fused as ``w13[e] = cat(W1[e], W3[e])``
(``[2I, H]``) and the down projection as ``w2[e]`` (``[H, I]``). Routing weights are applied
by the caller, so a pair's output does not depend on which other pairs share the call, on
where the expert was computed, or on the order of pairs: this is what lets caching, offload
and the q* split leave the model's output unchanged.

Some families' experts differ (``GatedAct``, ``cache/expert_math.py``): gpt-oss clamps the gate
and up rows and gates with ``gate * sigmoid(alpha gate) * (up + 1)``, and adds a bias to the gate
and up rows (``b13 [E, 2I]``, the row of expert ``pair_bias[p]``) and to the output; the output's
bias is added where the weighted rows are combined (layers/moe.py), so no kernel holds it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GatedAct:
    """How an expert's gate and up rows become the down projection's input: ``silu`` (silu(gate)
    * up) or ``swiglu_oai`` (gpt-oss: gate clamped above at ``limit``, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1), each op rounded to the data type as transformers'
    GptOssExperts rounds it)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SILU = GatedAct()


def _gate_up(xs: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor | None, bias_rows: torch.Tensor | None,
             act: GatedAct) -> torch.Tensor:
    """``act`` of the gate and up rows ``xs @ w13^T`` (plus each row's bias ``b13[bias_rows]``,
    added after the product's rounding)."""
    h = F.linear(xs, w13)
    if b13 is not None:
        h = h + b13.index_select(0, bias_rows).to(h.dtype)
    gate, up = h.chunk(2, dim=-1)
    return act(gate, up)


def dense_experts(w13: torch.Tensor, w2: torch.Tensor | None, pair_exp: torch.Tensor,
                  pair_bias: torch.Tensor | None, dtype: torch.dtype) -> tuple:
    """``(w13, w2, pair_exp, pair_bias)`` as dense weights in ``dtype``: themselves, or the
    pairs' experts alone, dequantized from MXFP4 rows (``kernels/mxfp4.py``) or converted from
    another dtype (a CPU engine's bfloat16 bank under float32, ``models/build.bank_store``), with
    ``pair_exp`` renumbered into them (``pair_bias`` keeping each pair's own expert for its bias
    row). ``w2`` None: the gate/up rows only."""
    if w13.dtype == dtype:
        return w13, w2, pair_exp, pair_bias
    from .mxfp4 import dequantize
    convert = (lambda w: dequantize(w, dtype)) if w13.dtype == torch.uint8 else (lambda w: w.to(dtype))
    used, inv = torch.unique(pair_exp, return_inverse=True)
    dense2 = None if w2 is None else convert(w2[used])
    return convert(w13[used]), dense2, inv.view_as(pair_exp), pair_exp if pair_bias is None else pair_bias


def expert_pairs_act(x: torch.Tensor, w13: torch.Tensor, pair_tok: torch.Tensor,
                     pair_exp: torch.Tensor, act: GatedAct = SILU, b13: torch.Tensor | None = None,
                     pair_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[P, I]`` in x.dtype: ``silu(gate) * up`` (``act``) of every pair, the first stage of
    ``expert_pairs_forward`` with its rounding (a split by stage runs the second elsewhere)."""
    w13, _, pair_exp, pair_bias = dense_experts(w13, None, pair_exp, pair_bias, x.dtype)
    inter = w13.shape[1] // 2
    bias = pair_exp if pair_bias is None else pair_bias
    out = x.new_empty((pair_tok.numel(), inter))
    for i, (t, e) in enumerate(zip(pair_tok.tolist(), pair_exp.tolist())):
        out[i] = _gate_up(x[t:t + 1], w13[e], b13, bias[i:i + 1], act)[0]
    return out


def expert_pairs_forward(
    x: torch.Tensor,          # [T, H]
    w13: torch.Tensor,        # [E, 2I, H]  (a bank layer or the cache's slot pool)
    w2: torch.Tensor,         # [E, H, I]
    pair_tok: torch.Tensor,   # [P] int64, index into x
    pair_exp: torch.Tensor,   # [P] int64, index into w13 / w2
    act: GatedAct = SILU,     # the gated activation
    b13: torch.Tensor | None = None,        # [E', 2I] the experts' gate/up biases, or None
    pair_bias: torch.Tensor | None = None,  # [P] each pair's row of b13 (default: pair_exp)
) -> torch.Tensor:            # [P, H] in x.dtype
    """Compute every (token, expert) pair; weights are read once per distinct expert.

    Pairs are grouped by expert (a stable sort), each group is two matmuls, and the results
    are written back in the caller's pair order. Accumulation follows torch's matmul for the
    dtype (float32 accumulate for bf16/fp16 on CPU). ``pair_bias`` tells a pair's expert where
    ``pair_exp`` holds cache slots (b13 is indexed by expert, the weights by slot).
    """
    if pair_tok.numel() == 0:
        return x.new_zeros((0, x.shape[1]))
    w13, w2, pair_exp, pair_bias = dense_experts(w13, w2, pair_exp, pair_bias, x.dtype)
    bias = pair_exp if pair_bias is None else pair_bias
    if pair_tok.numel() == 1:                       # one pair (decode, top-1): no grouping needed
        return F.linear(_gate_up(x[pair_tok], w13[pair_exp[0]], b13, bias, act), w2[pair_exp[0]])   # [1, H]
    order = torch.argsort(pair_exp, stable=True)
    experts, counts = torch.unique_consecutive(pair_exp[order], return_counts=True)
    xs = x.index_select(0, pair_tok[order])               # [P, H] grouped by expert
    bias = bias[order]
    outs = []
    start = 0
    # One group per distinct expert: the reference is readable, the compiled kernels fuse this.
    for e, n in zip(experts.tolist(), counts.tolist()):
        a = _gate_up(xs[start:start + n], w13[e], b13, bias[start:start + n], act)   # [n, I]
        outs.append(F.linear(a, w2[e]))                    # [n, H]
        start += n
    grouped = torch.cat(outs)                              # [P, H] in expert order
    return torch.empty_like(grouped).index_copy_(0, order, grouped)


class SplitRows(NamedTuple):
    """A decode layer's pair rows split between the device and the host (the CPU branch):
    pair p's row is ``gpu[p]`` where ``pair_slot[p] >= 0``, else the next row of ``host``
    (compact, in pair order; pinned host memory on a GPU) plus ``part[p]`` when the streamed
    split computed that pair's first rows on the device (``part`` is zero elsewhere)."""
    gpu: torch.Tensor                  # [P, H] (rows of host pairs are ignored)
    pair_slot: torch.Tensor            # [P] int, < 0: a host pair
    host: torch.Tensor                 # [>= host pairs, H]
    part: torch.Tensor | None = None   # [P, H] or None

    def dense(self) -> torch.Tensor:
        """The rows as one ``[P, H]`` tensor on the device (torch's ops)."""
        p = self.pair_slot.numel()
        cpu = self.pair_slot < 0
        rank = (torch.cumsum(cpu, 0) - 1).clamp_min(0)
        host = self.host[:p].to(self.gpu.device, non_blocking=True)[rank]
        if self.part is not None:
            host = host + self.part
        return torch.where(cpu[:, None], host, self.gpu)


def moe_combine_forward(rows: torch.Tensor | SplitRows, weights: torch.Tensor,
                        shared: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """An MoE layer's output from its pair rows ``[T*k, H]`` (or ``SplitRows``) and routing
    weights ``[T, k]``: ``sum_j weights[t, j] * rows[t*k + j]`` (each product rounded to the
    data type, summed in fp32 in the order of j, rounded), ``+ shared[t]`` (the shared expert's
    gated output, rounded), then ``residual[t] +`` (the decoder's residual add, rounded)."""
    if isinstance(rows, SplitRows):
        rows = rows.dense()
    out = (rows.view(*weights.shape, -1) * weights[..., None]).sum(dim=1)
    if shared is not None:
        out = out + shared
    return out if residual is None else residual + out


def add_rms_norm_forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's residual add followed by the next RMSNorm: ``(s, rms_norm(s))`` with
    ``s = residual + x`` rounded to the data type first."""
    s = residual + x
    return s, rms_norm_forward(s, weight, eps)


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dense projection ``x [T, K] @ weight [N, K]^T (+ bias [N]) -> [T, N]`` in ``x.dtype``:
    the specification of the compiled decode projection (``kernels/cpu/linear.py``)."""
    return F.linear(x, weight, bias)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension as layers/norm.py computes it: fp32 statistics; in bf16
    the normalised row is rounded to bf16 and then multiplied by the weight (one more rounding)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """layers/rope.apply_rotary's arithmetic: the first r (cos's width) of each head's dimensions
    rotate half as a roll under the signed sin, the rest pass."""
    r = cos.shape[-1]
    rot = x[..., :r] * cos + torch.roll(x[..., :r], r // 2, dims=-1) * sin
    return rot if r == x.shape[-1] else torch.cat((rot, x[..., r:]), dim=-1)


def decode_attention_forward(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                             q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                             cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slot: torch.Tensor, kv_index: torch.Tensor,
                             kv_len: torch.Tensor, window: int | None, scale: float,
                             sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over a paged KV pool (the compiled decode kernel's
    specification, kernels/cpu/attention.py). Writes the new K/V into ``k_cache``/``v_cache`` at
    ``slot`` and returns ``[B, heads * head_dim]`` in ``qkv.dtype``.

    qkv [B, (h + 2 kvh) d] (q heads, k heads, v heads); q_norm / k_norm [d] per-head RMSNorm
    weights or None; cos / signed sin [B, 1, r] (rotate-half as a roll over the first r <= d
    dimensions of each head, layers/rope.py: r < d a partial rotary); caches
    [S, kvh, d]; kv_index [B, Lmax] slot of each position; kv_len [B] keys per sequence (the new
    token included); the last ``window`` keys only when a window is given. Norm and rotary run
    in the data type; scores, softmax and the weighted sum in fp32. ``sinks [heads]``: each query
    head's sink logit joins its softmax's denominator (a column whose weight is dropped);
    ``chunk``: a token sees only the keys of its own chunk of that many positions.
    """
    b, d = qkv.shape[0], head_dim
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.reshape(b, heads, d), k.reshape(b, kv_heads, d), v.reshape(b, kv_heads, d)
    if q_norm is not None:
        q, k = rms_norm_forward(q, q_norm, eps), rms_norm_forward(k, k_norm, eps)
    q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
    v_cache[slot] = v                   # V first: the pool's V may be its K (cache/kv.py)
    k_cache[slot] = k
    out = []
    for i in range(b):
        n = int(kv_len[i])
        lo = max(0, n - window) if window else 0
        lo = max(lo, (n - 1) // chunk * chunk) if chunk else lo
        keys = k_cache[kv_index[i, lo:n]].float()                     # [L, kvh, d]
        values = v_cache[kv_index[i, lo:n]].float()
        qi = q[i].float().view(kv_heads, heads // kv_heads, d)        # [kvh, g, d]
        scores = torch.einsum("kgd,lkd->kgl", qi, keys) * scale
        if sinks is not None:
            scores = torch.cat((scores, sinks.float().view(kv_heads, -1, 1)), -1)
        probs = torch.softmax(scores, dim=-1)[..., :n - lo]
        out.append(torch.einsum("kgl,lkd->kgd", probs, values).reshape(-1))
    return torch.stack(out).to(qkv.dtype)
