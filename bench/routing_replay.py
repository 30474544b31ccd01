"""A generated routing replayed through the whole engine's routers (``engine_gpu_decode.py --routing``).

A random checkpoint's routers route each token to nearly the same experts step after step, so
the engine bench's expert cache had almost nothing to fill (0-13 fills a step, miss rates of
0.01-0.12, with 14-55% of the experts cached). The MoE-only bench (``gpu_offload.py``) instead replays a routing model fitted to the
default model's measured statistics (``offload_workload.make_routing``: per-layer Zipf popularity
and token-to-token overlap) or a uniform one. ``install`` gives the engine that routing: each
MoE block's router is wrapped so that, in a decode step of B sequences (B one of ``batches``),
it returns logits that select exactly the trace's k experts of that step, layer and sequence
(equal weights); any other call (a prefill chunk, another batch size) goes to the real router.

The step is a device counter that the first MoE layer's router advances, modulo the trace's
length, with in-place ops: a captured CUDA graph advances it on every replay, with no host work.
"""
from __future__ import annotations

import torch
from torch import nn

from offload_workload import ROOT, make_routing, routing_params

#: the logit of a traced expert; every other expert's is 0, so top-k picks exactly the trace's
PICK = 8.0


class ReplayRouter(nn.Module):
    """Stands in for a MoE block's ``gate``: ``tables[T] [S, L, T, E]`` logits for decode calls
    of T rows, the real ``gate`` for the rest."""

    def __init__(self, gate: nn.Module, layer: int, tables: dict[int, torch.Tensor], step: torch.Tensor,
                 first: bool):
        super().__init__()
        self.gate, self.layer, self.tables, self.step, self.first = gate, layer, tables, step, first
        if hasattr(gate, "e_score_correction_bias"):      # a biased router's (GLM, ERNIE): all zeros in
            self.e_score_correction_bias = gate.e_score_correction_bias   # the benches' checkpoints

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.tables.get(x.shape[0])
        if table is None:
            return self.gate(x)
        if self.first:                                   # one advance per decode step
            self.step.add_(1).remainder_(table.shape[0])
        return table.index_select(0, self.step)[0, self.layer]


def install(model, kind: str, batches: list[int], steps: int = 1024, seed: int = 0) -> dict:
    """Wrap the routers of ``model`` (a ``DecoderLM``) to replay a ``kind`` routing ("locality" or
    "uniform") of ``steps`` decode steps for each batch size in ``batches``; -> what was installed
    (the locality model's parameters, fitted to the default model's measured routing, and their
    source)."""
    blocks = model.moe_blocks()
    if not blocks:
        raise ValueError("the model has no MoE block to route")
    if any(isinstance(block.gate, ReplayRouter) for block in blocks):
        raise ValueError("the routers already replay a routing")
    E, k = blocks[0].moe.num_experts, blocks[0].moe.top_k
    shape = {"layers": len(blocks), "experts": E, "top_k": k}
    params = routing_params(ROOT, shape) if kind == "locality" else {}
    like = blocks[0].gate.weight                     # the tables in the router's dtype and device
    tables = {}
    for b in batches:
        ids = make_routing(shape, steps, b, kind, params, seed=seed + b)           # [S, L, b, k]
        logits = torch.zeros(steps, len(blocks), b, E, dtype=like.dtype)
        tables[b] = logits.scatter_(3, ids, PICK).to(like.device)
    step = torch.full((1,), -1, dtype=torch.int64, device=like.device)   # the first call makes it 0
    for i, block in enumerate(blocks):
        block.gate = ReplayRouter(block.gate, i, tables, step, first=i == 0)
    return {"kind": kind, "steps": steps, "params": {k: v for k, v in params.items() if not isinstance(v, str)},
            "source": params.get("source", "uniform")}


def traced_ids(model, batch: int) -> torch.Tensor:
    """The trace installed for ``batch`` rows: expert ids ``[S, L, batch, k]`` (host)."""
    gate = model.moe_blocks()[0].gate
    return gate.tables[batch].topk(model.moe_blocks()[0].moe.top_k, dim=-1).indices.cpu()


def install_guesses(model, accuracy: float, seed: int = 7) -> None:
    """Give each MoE block but the last a ``next_gate`` (the engine's cross-layer prefetch,
    FREETOKEN_EXPERT_PREFETCH=on) that guesses the next block's traced experts in the same decode
    step, each right with probability ``accuracy`` and otherwise replaced by an expert that token
    does not route to there (1.0: the trace itself, an oracle). Call after ``install``; the guess
    is made on this block's router input, which a replayed router ignores."""
    blocks = model.moe_blocks()
    gates = [block.gate for block in blocks]
    if not all(isinstance(g, ReplayRouter) for g in gates):
        raise ValueError("install the replayed routing first")
    k = blocks[0].moe.top_k
    gen = torch.Generator().manual_seed(seed)
    noisy = {}
    for b, table in gates[0].tables.items():
        ids = table.float().topk(k, dim=-1).indices.cpu()                          # [S, L, b, k]
        scores = torch.rand(table.shape, generator=gen)
        others = scores.scatter_(3, ids, -1.0).topk(k, dim=-1).indices           # k experts not routed
        wrong = torch.rand(ids.shape, generator=gen) >= accuracy
        guess = torch.where(wrong, others, ids)
        noisy[b] = torch.zeros(table.shape, dtype=table.dtype).scatter_(3, guess, PICK).to(table.device)
    for i, block in enumerate(blocks[:-1]):
        block.next_gate = ReplayRouter(gates[i + 1].gate, i + 1, noisy, gates[0].step, first=False)
