"""Sparse MoE block: router, routed experts (delegated to an expert executor), shared expert.

The expert executor is attached after construction (``attach_experts``): where experts live
(cache, bank, CPU) is an offload concern, not the model's.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MoeConfig
from ..kernels import gpu_decode_kernels
from ..kernels.cpu.combine import moe_combine
from ..kernels.reference import SILU, GatedAct, SplitRows
from .mlp import GatedMLP


class Fp32Router(nn.Linear):
    """A router kept in float32 whatever the model's dtype, as transformers keeps some (Flint):
    float32 weights, float32 logits."""

    def _apply(self, fn, recurse=True):
        # a model-wide .to(bfloat16) leaves the router in float32
        return super()._apply(lambda t: fn(t).float() if t.is_floating_point() else fn(t), recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias)


class BiasedRouter(Fp32Router):
    """The router of a biased choice (GLM-4.5, ERNIE-4.5, DeepSeek-V3): float32 as transformers
    keeps it, and ``e_score_correction_bias``, a per-expert offset that steers which experts are
    chosen but not their weights."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__(hidden, num_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)


def biased_route(logits: torch.Tensor, bias: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (float32 weights [T, k], expert ids [T, k]) of float32 router logits [T, E], as
    transformers' Glm4MoeTopkRouter and Ernie4_5_MoeTopKRouter compute them: sigmoid (softmax)
    scores; the experts outside the best ``topk_group`` groups (a group's worth: its two best
    biased scores, or its best one: ``group_score`` "max", DeepSeek-V2) masked; the top k of the
    biased scores (``bias_on_logits``: of the biased logits, Kolibri) chosen; their unbiased scores
    as weights, renormalised with ``norm_topk_prob`` and times ``routed_scaling_factor``."""
    scores = logits.sigmoid() if moe.scoring == "sigmoid" else F.softmax(logits, dim=-1, dtype=torch.float32)
    choice = (logits if moe.bias_on_logits else scores) + bias
    if moe.topk_group < moe.n_group:
        t, g = choice.shape[0], moe.n_group
        grouped = choice.view(t, g, -1)
        best = grouped.amax(dim=-1) if moe.group_score == "max" else grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(best).scatter_(1, best.topk(moe.topk_group, dim=-1, sorted=False).indices, 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(moe.num_experts // g, dim=1), float("-inf"))
    ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total.clamp(min=moe.norm_floor) if moe.norm_floor else total + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (float32 weights [T, 2], expert ids [T, 2]) as Phi-3.5-MoE routes at inference
    (transformers' ``sparsemixer``): the best logit's expert, weighted by its softmax over the
    logits within relative distance 2 eps of it (the rest masked); then the best of the others,
    weighted by its softmax over the others within 2 eps of it. Not renormalised."""
    scores = logits.float()
    first, one = scores.max(dim=-1, keepdim=True)
    rest = scores.scatter(-1, one, float("-inf"))
    second, two = rest.max(dim=-1, keepdim=True)
    weights = [_near_softmax(among, scores, best, eps).gather(-1, at)
               for among, best, at in ((scores, first, one), (rest, second, two))]
    return torch.cat(weights, dim=-1), torch.cat((one, two), dim=-1)


def _near_softmax(among: torch.Tensor, scores: torch.Tensor, best: torch.Tensor, eps: float) -> torch.Tensor:
    """Softmax of ``among`` with the logits whose distance below ``best``, relative to
    max(|logit|, best), passes 2 eps masked out."""
    far = (best - scores) / scores.abs().clamp(min=best) > 2 * eps
    return F.softmax(among.masked_fill(far, float("-inf")), dim=-1)


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, moe: MoeConfig, moe_layer: int):
        super().__init__()
        self.moe, self.moe_layer = moe, moe_layer
        if moe.biased:
            self.gate = BiasedRouter(hidden, moe.num_experts)
        else:
            self.gate = (Fp32Router if moe.router_fp32 else nn.Linear)(hidden, moe.num_experts, bias=moe.router_bias)
        self.act = GatedAct(moe.activation, moe.swiglu_alpha, moe.swiglu_limit) if moe.activation != "silu" else SILU
        if moe.expert_bias:
            # the routed experts' biases (gpt-oss): small, so they stay with the layer's other
            # weights on the device; b13 rows are each expert's gate biases, then its up ones
            self.expert_b13 = nn.Parameter(torch.zeros(moe.num_experts, 2 * moe.intermediate_size), requires_grad=False)
            self.expert_b2 = nn.Parameter(torch.zeros(moe.num_experts, hidden), requires_grad=False)
        else:
            self.expert_b13 = self.expert_b2 = None
        if moe.shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden, moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if moe.shared_gate else None
        else:
            self.shared_expert = None
        self.experts = None   # set by attach_experts
        # the next MoE layer's router, when decode prefetches its guessed experts (DecoderLM)
        self.next_gate: nn.Linear | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] in x.dtype, expert ids [T, k])."""
        logits = self.gate(x)                                            # [T, E]
        gpu = gpu_decode_kernels("route") if x.device.type == "cuda" else None
        if self.moe.biased:
            return self._biased(self.gate, logits, x.dtype, gpu)
        if self.moe.scoring == "sparsemixer":
            weights, ids = sparsemixer(logits, self.moe.jitter_eps)
            return weights.to(x.dtype), ids
        if self.moe.scoring == "sigmoid":                 # Llama 4, Cohere: sigmoid of the top logits, no bias
            top, ids = torch.topk(logits, self.moe.top_k, dim=-1)
            weights = torch.sigmoid(top.float())
            if self.moe.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights.to(x.dtype), ids
        if gpu is not None and gpu.supported(logits, self.moe.top_k):     # one launch
            return gpu.route(logits, self.moe.top_k, self.moe.scoring != "unit", self.moe.norm_topk_prob, x.dtype)
        if self.moe.scoring == "unit":
            ids = torch.topk(logits, self.moe.top_k, dim=-1).indices
            return torch.ones(ids.shape, dtype=x.dtype, device=x.device), ids
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if weights.dtype == x.dtype else weights.to(x.dtype)), ids

    def _biased(self, gate: BiasedRouter, logits: torch.Tensor, dtype: torch.dtype, gpu):
        """(weights, ids) of a biased choice; on a GPU in one launch (kernels/triton/route.py)."""
        if gpu is not None and gpu.supported_biased(logits, self.moe):
            return gpu.route_biased(logits, gate.e_score_correction_bias, self.moe, dtype)
        weights, ids = biased_route(logits, gate.e_score_correction_bias, self.moe)
        return weights.to(dtype), ids

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's gated output ``[T, H]`` (the layer must have one)."""
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return shared * 0.5 if self.moe.average_shared else shared

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for x [T, H], plus ``residual`` when given (the decoder's residual
        add, fused into the combine on a GPU)."""
        weights, ids = self.route(x)
        if self.moe.average_shared:       # Cohere: the mean of the routed and the shared outputs
            weights = weights * 0.5
        routed = x
        if self.moe.scale_input:          # Llama 4: the weight scales the (one) expert's input
            routed, weights = x * weights, torch.ones_like(weights)
        if self.next_gate is not None and self.experts.wants_guess(self.moe_layer, x.shape[0]):
            # the next layer's experts guessed from this layer's router input: copied while this
            # layer computes (OffloadedExperts.guess); a wrong guess costs a fill, never a result
            logits = self.next_gate(x)
            gpu = gpu_decode_kernels("route") if x.is_cuda else None
            guess = self._biased(self.next_gate, logits, x.dtype, gpu)[1] if self.moe.biased \
                else torch.topk(logits, self.moe.top_k, dim=-1).indices
            self.experts.guess(self.moe_layer + 1, guess)
        # [T*k, H] or SplitRows; on a GPU the shared expert runs beside the hits while fills copy
        beside = None if self.shared_expert is None else functools.partial(self.shared, x)
        # experts of another kind (gpt-oss) take self.act and self.expert_b13 from the executor's
        # ExpertMath, which the runner gave them
        rows, shared = self.experts.forward_beside(self.moe_layer, routed, ids, beside)
        if self.expert_b2 is not None:    # sum_j w_j (row_j + b2[e_j]): the biases' share beside the rows
            biases = (self.expert_b2[ids] * weights[..., None]).sum(dim=1)
            shared = biases if shared is None else shared + biases
        dense = rows.gpu if isinstance(rows, SplitRows) else rows
        gpu = gpu_decode_kernels("combine") if dense.device.type == "cuda" else None
        if gpu is not None and not (torch.is_grad_enabled() and dense.requires_grad) \
                and gpu.supported(rows, weights, shared, residual):
            return gpu.combine(rows, weights, shared, residual)            # one launch
        return moe_combine(rows, weights, shared, residual)                # one compiled call on the CPU
