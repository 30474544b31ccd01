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
