"""Perplexity and routing traces of a dense llama and its MoE split, on transformers' llama.

`MaskedMoeMLP` computes the same function as `moe.MoeMLP` (top-k experts by router logits,
unit weights) in a form that is fast for evaluation: the dense activations masked by the
selected experts' neurons. It also records which experts each token chose, for the routing
statistics. Used by the offline fitting (`fit.py`) and `bench/default_model.py`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def dense_transformers_model(config: dict, tensors: dict[str, torch.Tensor]):
    """transformers' LlamaForCausalLM holding `tensors` (HF keys), float32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.load_state_dict(tensors, strict=False)
    if cfg.get("tie_word_embeddings", True):
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.float().eval()


class MaskedMoeMLP(nn.Module):
    """A dense llama MLP evaluated as an MoE: only the top-k experts' neurons contribute.

    `owner[j]` is the expert that owns neuron j; `router` is [E, H]. `top_k=None` means dense.
    `oracle=True` picks the experts with the largest true output norm instead of the router's.
    """

    def __init__(self, dense_mlp: nn.Module, owner: torch.Tensor, router: torch.Tensor,
                 top_k: int | None, oracle: bool = False):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = dense_mlp.gate_proj, dense_mlp.up_proj, dense_mlp.down_proj
        self.owner = owner.long()
        self.router = router.float()
        self.top_k = top_k
        self.oracle = oracle
        self.trace: list[torch.Tensor] = []  # per call: [T, k] chosen experts
        self.record = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = F.silu(self.gate_proj(x)) * self.up_proj(x)  # [..., I]
        if self.top_k is None:
            return self.down_proj(act)
        num_experts = self.router.shape[0]
        if self.oracle:
            onehot = F.one_hot(self.owner, num_experts).to(act.dtype)  # [I, E]
            w = self.down_proj.weight  # [H, I]
            score = torch.stack([
                (act * onehot[:, e]) @ w.T for e in range(num_experts)
            ], dim=-2).norm(dim=-1)  # [..., E]
        else:
            score = x @ self.router.T  # [..., E]
        chosen = score.topk(self.top_k, dim=-1).indices  # [..., k]
        if self.record:
            self.trace.append(chosen.reshape(-1, self.top_k).to(torch.int16).cpu())
        keep = torch.zeros_like(score).scatter_(-1, chosen, 1.0)  # [..., E]
        return self.down_proj(act * keep[..., self.owner])


def install_moe(model, perms: torch.Tensor, routers: torch.Tensor, top_k: int | None,
                oracle: bool = False) -> list[MaskedMoeMLP]:
    """Replace every layer's MLP of a dense transformers llama by a MaskedMoeMLP (in place)."""
    mlps = []
    num_experts = routers.shape[1]
    for i, layer in enumerate(model.model.layers):
        base = layer.mlp  # a dense LlamaMLP or a MaskedMoeMLP: both hold the three projections
        size = perms.shape[1] // num_experts
        owner = torch.empty(perms.shape[1], dtype=torch.long)
        owner[perms[i].long()] = torch.arange(perms.shape[1]) // size
        mlp = MaskedMoeMLP(base, owner, routers[i], top_k, oracle)
        layer.mlp = mlp
        mlps.append(mlp)
    return mlps


@torch.no_grad()
def perplexity(model, windows: list[list[int]]) -> float:
    """exp(mean next-token NLL) over the windows (each scored on its own)."""
    total, count = 0.0, 0
    for ids in windows:
        x = torch.tensor([ids])
        logits = model(x).logits[0, :-1].float()  # [T-1, V]
        nll = F.cross_entropy(logits, x[0, 1:], reduction="sum")
        total += nll.item()
        count += len(ids) - 1
    return math.exp(total / count)
