"""The MoE router's selection on the GPU in one launch: softmax (fp32), top-k, renormalisation.

torch's path is six launches a layer (softmax, two for top-k, the sum, the division, the cast;
``bench/engine_profile.py``). One program per token: the softmax over its E logits in fp32, then k
rounds of "take the largest, lowest index first among equal ones", then, with ``norm``, the k
weights divided by their sum; weights in ``out_dtype``, ids int64. Same arithmetic as
``layers/moe.py``'s torch path up to the softmax's summation order (fp32), so weights agree to
fp32 rounding and ids agree except between experts of equal probability, where torch's order is
unspecified and this one takes the lower index. With ``softmax=False`` (the "unit" scoring) the
top-k of the logits themselves and weights of one. NaN scores rank below every number, so a NaN
hidden state still yields k distinct expert ids inside [0, E) (its weights are NaN).

``route_biased`` is the same for a biased choice (GLM-4.5, ERNIE-4.5: ``layers/moe.biased_route``,
a dozen launches in torch): sigmoid or softmax scores, the correction bias added to choose, the
best groups kept (a group's worth: its two best biased scores), the top k, their unbiased scores
as weights, renormalised and scaled.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2


@triton.jit
def _route_kernel(logits, w_out, id_out, E, K: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                  SOFTMAX: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    em = e < E
    x = tl.load(logits + t * E + e, mask=em, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        p = tl.exp(x - tl.max(x, 0))
        p = p / tl.sum(p, 0)
        p = tl.where(em, p, float("-inf"))
    else:
        p = x
    kk = tl.arange(0, BK)
    vals = tl.zeros([BK], tl.float32)
    ids = tl.zeros([BK], tl.int64)
    # NaN (a NaN hidden state, e.g. fp16 overflow) ranks lowest, and a taken expert is never taken
    # again even when every score left is -inf: ids stay distinct and inside [0, E) whatever the
    # logits (a NaN compares unequal to the maximum, which once gave the id E: an illegal access)
    p = tl.where(p == p, p, float("-inf"))
    free = em
    for j in tl.static_range(K):
        best = tl.max(tl.where(free, p, float("-inf")), 0)
        idx = tl.min(tl.where(free & (p >= best), e, BE), 0)
        vals = tl.where(kk == j, best, vals)
        ids = tl.where(kk == j, idx.to(tl.int64), ids)
        free = free & (e != idx)
    if not SOFTMAX:
        vals = tl.zeros([BK], tl.float32) + 1.0
    if NORM:
        vals = vals / tl.sum(tl.where(kk < K, vals, 0.0), 0)
    tl.store(w_out + t * K + kk, vals.to(w_out.dtype.element_ty), mask=kk < K)
    tl.store(id_out + t * K + kk, ids, mask=kk < K)


def supported(logits: torch.Tensor, k: int) -> bool:
    return logits.dim() == 2 and logits.is_contiguous() and 0 < k <= logits.shape[1] <= 1024


def route(logits: torch.Tensor, k: int, softmax: bool, norm: bool, out_dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in out_dtype, expert ids [T, k] int64), best first."""
    t, e = logits.shape
    weights = torch.empty((t, k), dtype=out_dtype, device=logits.device)
    ids = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, weights, ids, e, K=k, BE=next_pow2(e), BK=next_pow2(k),
                            SOFTMAX=softmax, NORM=norm and softmax)
    return weights, ids


@triton.jit
def _biased_kernel(logits, bias, w_out, id_out, E, scale, floor, K: tl.constexpr, BE: tl.constexpr,
                   BK: tl.constexpr, SIGMOID: tl.constexpr, NORM: tl.constexpr, G: tl.constexpr,
                   PER: tl.constexpr, TOPG: tl.constexpr, BG: tl.constexpr, TOP2: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    em = e < E
    x = tl.load(logits + t * E + e, mask=em, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        s = tl.exp(x - tl.max(x, 0))
        s = s / tl.sum(s, 0)
    c = s + tl.load(bias + e, mask=em, other=0.0).to(tl.float32)
    c = tl.where(em & (c == c), c, float("-inf"))          # padding and NaN rank below every score
    if G > 1:
        # a group's worth is its two best biased scores (or its best); experts outside the TOPG best groups drop out
        grp = e // PER
        gg = tl.arange(0, BG)
        worth = tl.zeros([BG], tl.float32) + float("-inf")
        for g in tl.static_range(G):
            inside = em & (grp == g)
            m1 = tl.max(tl.where(inside, c, float("-inf")), 0)
            i1 = tl.min(tl.where(inside & (c >= m1), e, BE), 0)
            if TOP2:
                m2 = tl.max(tl.where(inside & (e != i1), c, float("-inf")), 0)
                worth = tl.where(gg == g, m1 + m2, worth)
            else:                                    # its best one (DeepSeek-V2)
                worth = tl.where(gg == g, m1, worth)
        worth = tl.where(worth == worth, worth, float("-inf"))
        gfree = gg < G
        keep = e < 0
        for j in tl.static_range(TOPG):
            best = tl.max(tl.where(gfree, worth, float("-inf")), 0)
            gi = tl.min(tl.where(gfree & (worth >= best), gg, BG), 0)
            keep = keep | (grp == gi)
            gfree = gfree & (gg != gi)
        c = tl.where(keep, c, float("-inf"))
    kk = tl.arange(0, BK)
    vals = tl.zeros([BK], tl.float32)
    ids = tl.zeros([BK], tl.int64)
    free = em
    for j in tl.static_range(K):
        best = tl.max(tl.where(free, c, float("-inf")), 0)
        idx = tl.min(tl.where(free & (c >= best), e, BE), 0)
        vals = tl.where(kk == j, tl.sum(tl.where(e == idx, s, 0.0), 0), vals)   # its unbiased score
        ids = tl.where(kk == j, idx.to(tl.int64), ids)
        free = free & (e != idx)
    if NORM:
        total = tl.sum(tl.where(kk < K, vals, 0.0), 0)
        vals = vals / tl.where(floor > 0, tl.maximum(total, floor), total + 1e-20)
    vals = vals * scale
    tl.store(w_out + t * K + kk, vals.to(w_out.dtype.element_ty), mask=kk < K)
    tl.store(id_out + t * K + kk, ids, mask=kk < K)


def supported_biased(logits: torch.Tensor, moe) -> bool:
    """Whether ``route_biased`` takes these float32 router logits and that routing (``MoeConfig``)."""
    return (logits.dim() == 2 and logits.is_contiguous() and logits.dtype == torch.float32
            and 0 < moe.top_k <= logits.shape[1] <= 1024 and moe.n_group <= 64 and not moe.bias_on_logits)


def route_biased(logits: torch.Tensor, bias: torch.Tensor, moe, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers/moe.biased_route`` in one launch: float32 logits [T, E] and the correction bias
    [E] -> (weights [T, k] in out_dtype, expert ids [T, k] int64), best biased score first. The
    same arithmetic up to the softmax's summation order; ids agree except between equal scores,
    where this kernel takes the lower index (a group too)."""
    t, e = logits.shape
    weights = torch.empty((t, moe.top_k), dtype=out_dtype, device=logits.device)
    ids = torch.empty((t, moe.top_k), dtype=torch.int64, device=logits.device)
    grouped = moe.topk_group < moe.n_group
    if t:
        _biased_kernel[(t,)](logits, bias, weights, ids, e, float(moe.routed_scaling_factor), float(moe.norm_floor),
                             K=moe.top_k, BE=next_pow2(e), BK=next_pow2(moe.top_k),
                             SIGMOID=moe.scoring == "sigmoid", NORM=bool(moe.norm_topk_prob),
                             G=moe.n_group if grouped else 1, PER=e // moe.n_group if grouped else e,
                             TOPG=moe.topk_group, BG=next_pow2(moe.n_group), TOP2=moe.group_score == "top2")
    return weights, ids
