"""Routing statistics of an MoE on real text: popularity skew, temporal overlap, global-LRU misses.

Input everywhere: `trace` = one int tensor per layer, [T, k], the experts each token chose
(in token order), as recorded by `evaluate.MaskedMoeMLP`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


def popularity(trace: list[torch.Tensor], num_experts: int) -> dict:
    """Per layer, the share of routed slots each expert got; summarised over layers.

    `max_over_uniform`: the most popular expert's share / (1/E) (1.0 = perfectly balanced);
    `normalized_entropy`: entropy of the shares / log E (1.0 = balanced).
    """
    maxes, ents, shares = [], [], []
    for t in trace:
        counts = torch.bincount(t.flatten().long(), minlength=num_experts).double()
        p = counts / counts.sum()
        shares.append(p.tolist())
        maxes.append(float(p.max() * num_experts))
        nz = p[p > 0]
        ents.append(float(-(nz * nz.log()).sum() / torch.log(torch.tensor(float(num_experts)))))
    return {
        "max_over_uniform_mean": sum(maxes) / len(maxes),
        "max_over_uniform_worst": max(maxes),
        "normalized_entropy_mean": sum(ents) / len(ents),
        "normalized_entropy_min": min(ents),
        "shares_per_layer": shares,
    }


def consecutive_overlap(trace: list[torch.Tensor]) -> dict:
    """Mean |S_t ∩ S_{t+1}| / k over consecutive tokens, per layer and overall."""
    per_layer = []
    for t in trace:
        a, b = t[:-1].long(), t[1:].long()
        same = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1).double()  # [T-1]
        per_layer.append(float(same.mean() / t.shape[1]))
    return {"mean": sum(per_layer) / len(per_layer), "per_layer": per_layer}


def random_overlap(num_experts: int, top_k: int) -> float:
    """Expected overlap of two independent uniformly random k-subsets of E experts: k / E."""
    return top_k / num_experts


def lru_miss_rate(trace: list[torch.Tensor], capacity: int) -> float:
    """Miss rate of one global LRU cache of `capacity` (layer, expert) slots.

    Access order follows a decode: token by token, layer by layer, each layer's k experts.
    """
    cache: OrderedDict = OrderedDict()
    misses = total = 0
    rows = [t.tolist() for t in trace]
    for tok in range(len(rows[0])):
        for layer, r in enumerate(rows):
            for e in r[tok]:
                key = (layer, e)
                total += 1
                if key in cache:
                    cache.move_to_end(key)
                else:
                    misses += 1
                    cache[key] = None
                    if len(cache) > capacity:
                        cache.popitem(last=False)
    return misses / total


def random_trace_like(trace: list[torch.Tensor], num_experts: int, seed: int = 0) -> list[torch.Tensor]:
    """Same shape as `trace`, experts drawn uniformly without replacement (a no-locality baseline)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in trace:
        tokens, k = t.shape
        out.append(torch.rand(tokens, num_experts, generator=g).topk(k, dim=-1).indices.to(torch.int16))
    return out
