"""Readable PyTorch reference for every expert kernel: the CPU path, the CI path and the spec.

An MoE layer's routed work is a list of (token, expert) *pairs*. Each pair's output is

    y[p] = W2[e] @ (silu(W1[e] @ x[t]) * (W3[e] @ x[t]))      t = pair_tok[p], e = pair_exp[p]

with the gate (W1) and up (W3) projections stored fused as ``w13[e] = cat(W1[e], W3[e])``
(``[2I, H]``) and the down projection as ``w2[e]`` (``[H, I]``). Routing weights are applied
by the caller, so a pair's output does not depend on which other pairs share the call, on
where the expert was computed, or on the order of pairs: this is what lets caching, offload
and the q* split leave the model's output unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_pairs_forward(
    x: torch.Tensor,          # [T, H]
    w13: torch.Tensor,        # [E, 2I, H]  (a bank layer or the cache's slot pool)
    w2: torch.Tensor,         # [E, H, I]
    pair_tok: torch.Tensor,   # [P] int64, index into x
    pair_exp: torch.Tensor,   # [P] int64, index into w13 / w2
) -> torch.Tensor:            # [P, H] in x.dtype
    """Compute every (token, expert) pair; weights are read once per distinct expert.

    Pairs are grouped by expert (a stable sort), each group is two matmuls, and the results
    are written back in the caller's pair order. Accumulation follows torch's matmul for the
    dtype (float32 accumulate for bf16/fp16 on CPU).
    """
    if pair_tok.numel() == 0:
        return x.new_zeros((0, x.shape[1]))
    if w13.dtype != x.dtype:
        w13, w2 = w13.to(x.dtype), w2.to(x.dtype)
    if pair_tok.numel() == 1:                       # one pair (decode, top-1): no grouping needed
        h = F.linear(x[pair_tok], w13[pair_exp[0]])            # [1, 2I]
        gate, up = h.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2[pair_exp[0]])   # [1, H]
    order = torch.argsort(pair_exp, stable=True)
    experts, counts = torch.unique_consecutive(pair_exp[order], return_counts=True)
    xs = x.index_select(0, pair_tok[order])               # [P, H] grouped by expert
    outs = []
    start = 0
    # One group per distinct expert: the reference is readable, the compiled kernels fuse this.
    for e, n in zip(experts.tolist(), counts.tolist()):
        h = F.linear(xs[start:start + n], w13[e])          # [n, 2I]
        gate, up = h.chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, w2[e]))    # [n, H]
        start += n
    grouped = torch.cat(outs)                              # [P, H] in expert order
    return torch.empty_like(grouped).index_copy_(0, order, grouped)
