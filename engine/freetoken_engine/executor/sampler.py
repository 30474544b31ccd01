"""Sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidRequest, NonFiniteLogits


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature <= 100:
            raise InvalidRequest(f"temperature must be within 0..100, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be within (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")


def make_generator(params: SamplingParams, fallback_seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token from ``logits [V]`` (float32). Sampling runs on the CPU for reproducibility.
    Raises NonFiniteLogits when a logit is NaN or +inf, or every one is -inf (one reduction:
    max propagates NaN)."""
    best, arg = logits.max(0)
    if not math.isfinite(float(best)):
        raise NonFiniteLogits(f"the model produced non-finite logits (max {float(best)}) for this request: "
                              "the checkpoint or its dtype overflows; try --dtype bfloat16 or float32")
    if params.temperature == 0:
        return int(arg)
    x = logits.float().cpu() / params.temperature
    if params.top_k and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p   # keep the smallest set reaching top_p
        x[order[drop]] = float("-inf")
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
