"""Sampling: greedy, temperature, top-k, top-p, min-p, with a per-request seeded generator;
a grammar's mask (``guide.py``), logit biases and repetition penalties (``penalties.py``)
apply first, in that order. Log-probabilities are the model's own
(``token_logprobs``: the raw logits' log-softmax, before bias, mask and temperature), as vLLM
reports them by default."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidRequest, NonFiniteLogits
from .guide import Guide, GuideSpec, tables_ready
from .penalties import Penalties

#: most alternatives a request can ask log-probabilities for (OpenAI's limit)
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit), -100..100
    logprobs: int | None = None     # report the chosen token's log-probability and this many alternatives
    guide: GuideSpec | None = None  # the output follows this grammar
    presence_penalty: float = 0.0   # OpenAI's, -2..2 (penalties.py)
    frequency_penalty: float = 0.0  # OpenAI's, -2..2
    repetition_penalty: float = 1.0  # vLLM's and transformers', > 0 (1 = off)
    min_p: float = 0.0              # drop tokens below min_p times the likeliest's probability

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature <= 100:
            raise InvalidRequest(f"temperature must be within 0..100, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be within (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise InvalidRequest(f"logit_bias: token {token} bias {bias}: ids are >= 0 and "
                                     "biases within -100..100")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequest(f"{name} must be within -2..2, got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise InvalidRequest(f"repetition_penalty must be within (0, 10], got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be within 0..1, got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be within 0..{MAX_LOGPROBS}, got {self.logprobs}")


def make_generator(params: SamplingParams, fallback_seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return g


def check_guided(params: SamplingParams, tokenizer, n_vocab: int) -> None:
    """What a request's bias and grammar need: ids within the vocabulary, a tokenizer; starts
    building the grammar engine's tables (``guide.tables_ready``). Raises InvalidRequest."""
    bad = next((t for t, _ in params.logit_bias if t >= n_vocab), None)
    if bad is not None:
        raise InvalidRequest(f"logit_bias: token id {bad} is outside the vocabulary (0..{n_vocab - 1})")
    if params.guide is not None:
        if tokenizer is None:
            raise InvalidRequest("constrained decoding needs the model's tokenizer (tokenizer.json or "
                                 "tiktoken.model), and this model has none")
        tables_ready(tokenizer, n_vocab)


def make_guide(params: SamplingParams, tokenizer, n_vocab: int) -> Guide | None:
    """The request's grammar state (waiting for the grammar tables), or None. Raises InvalidRequest."""
    check_guided(params, tokenizer, n_vocab)
    return None if params.guide is None else Guide(params.guide, tokenizer, n_vocab)


def make_penalties(params: SamplingParams, prompt_ids: list[int], n_vocab: int) -> Penalties | None:
    return Penalties(params, prompt_ids, n_vocab) if Penalties.wanted(params) else None


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator,
           penalties: Penalties | None = None) -> int:
    """One token from ``logits [V]`` (float32, a grammar's mask already applied: ``Guide``;
    left unchanged); ``penalties`` is the request's (the caller adds the token to it). Sampling
    runs on the CPU for reproducibility. Raises NonFiniteLogits when a logit is NaN or +inf, or
    every one is -inf (one reduction: max propagates NaN)."""
    best, arg = logits.max(0)
    if not math.isfinite(float(best)):
        raise NonFiniteLogits(f"the model produced non-finite logits (max {float(best)}) for this request: "
                              "the checkpoint or its dtype overflows; try --dtype bfloat16 or float32")
    if params.temperature == 0 and not params.logit_bias and penalties is None:
        return int(arg)
    x = logits.detach().to("cpu", torch.float32, copy=True)
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < x.numel()], dtype=torch.long)
        x[ids] += torch.tensor([b for t, b in params.logit_bias if t < x.numel()])
    if penalties is not None:
        penalties.apply(x)
    if params.temperature == 0:
        return int(x.argmax())
    x /= params.temperature
    if params.top_k and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p   # keep the smallest set reaching top_p
        x[order[drop]] = float("-inf")
    probs = torch.softmax(x, dim=-1)
    if params.min_p:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=gen))


def token_logprobs(logits: torch.Tensor, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The model's log-probability of ``token`` and its ``n`` likeliest tokens with theirs."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(lp, n) if n else None
    alts = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return float(lp[token]), alts
