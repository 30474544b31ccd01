"""One request's run through the EngineService, as text, for both protocol modules.

``start_choices`` tokenizes nothing: it takes the rendered prompt, checks the context budget,
submits to the service (so 413 / 429 / 400 are raised *before* any response is started) and
returns a ``Generation`` per choice. Iterating one yields decoded text pieces with stop strings applied; afterwards
``finish_reason`` is ``"stop"`` (EOS or a stop string) or ``"length"``, and the token counts
are final. An abort the server did not ask for raises ``ApiError(503)``. ``close()`` aborts
the request in the engine (client disconnect, stop string) and is idempotent; the protocol
modules call it in ``finally``. With ``logprobs`` asked for, each token's entry (OpenAI chat's
shape) is collected in ``logprobs``; ``take_logprobs()`` returns those not yet taken (for a
stream's next chunk).
"""
from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from ..errors import RequestTooLong
from ..executor.guide import GuideSpec
from ..executor.sampler import SamplingParams
from .errors import ApiError
from .parser import ALWAYS_KEPT, format_tags
from .stops import StopMatcher
from .structured import LogprobText, guide_spec

#: Upper bound accepted for max_tokens before clamping to the context (anything larger is a typo).
MAX_TOKENS_LIMIT = 1 << 31


@dataclass(frozen=True)
class GenOptions:
    """Sampling and stopping, validated by the protocol modules before they build this."""

    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None       # alternatives per token; None: no log-probabilities
    grammar: str | None = None        # the answer follows it (server/structured.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0


class Generation:
    """Async iterator of text pieces for one submitted request (see the module docstring)."""

    def __init__(self, handle, tokenizer, stops: Sequence[str], skip_ids: frozenset[int],
                 metrics=None, endpoint: str = "", t_arrival: float | None = None,
                 logprob_text: LogprobText | None = None, keep: tuple[str, ...] = ()):
        self.handle = handle
        self.logprob_text = logprob_text
        self.logprobs: list[dict] = []
        self._taken = 0
        self.decoder = tokenizer.stream_decoder(keep)      # tool-call tags the tokenizer marks special
        self.matcher = StopMatcher(stops)
        self.skip_ids = skip_ids
        self.metrics = metrics
        self.endpoint = endpoint
        self.t_arrival = time.monotonic() if t_arrival is None else t_arrival
        self.t_first: float | None = None
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        self._closed = False

    @property
    def prompt_tokens(self) -> int:
        return int(self.handle.prompt_tokens or 0)

    @property
    def cached_tokens(self) -> int:
        return int(self.handle.cached_tokens or 0)

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            if self.logprob_text is not None:
                await self.logprob_text.ready()   # the engine runs on meanwhile; its events wait
            async for ev in self.handle:
                text = ""
                if ev.token_id is not None:      # a final event may carry no token (abort)
                    self.completion_tokens += 1
                    if self.t_first is None:
                        self.t_first = time.monotonic()
                    if ev.token_id not in self.skip_ids:
                        text = self.decoder.step(ev.token_id)
                        if ev.logprob is not None and self.logprob_text is not None:
                            self.logprobs.append(self.logprob_text.chat(ev.token_id, ev.logprob))
                shown = self.matcher.feed(text) if text else ""
                if shown:
                    yield shown
                if self.matcher.stopped:
                    self.finish_reason, self.stop_string = "stop", self.matcher.matched
                    break
                if ev.finish_reason == "abort" and ev.error is not None:
                    raise ev.error                # an EngineError: mapped to its status (e.g. 413)
                if ev.finish_reason == "abort":   # not ours (close() was not called)
                    raise ApiError(503, "the engine stopped this request before it finished "
                                        "(it does not fit the KV cache, or the engine failed; "
                                        "see the server log)", code="engine_abort")
                if ev.finish_reason is not None:
                    self.finish_reason = ev.finish_reason
                    break
            tail = self.matcher.flush()
            if tail:
                yield tail
            if self.finish_reason is None:
                self.finish_reason = "stop"
        finally:
            self.close()

    def take_logprobs(self) -> list[dict]:
        out = self.logprobs[self._taken:]
        self._taken = len(self.logprobs)
        return out

    def close(self) -> None:
        """Abort in the engine if still running; record metrics once."""
        if self._closed:
            return
        self._closed = True
        if self.finish_reason is None or self.matcher.stopped:
            self.handle.abort()
        if self.metrics is not None:
            self.metrics.observe_generation(self)


class Choices(list):
    """The generations of a request's ``n`` choices (one prompt): ``close()`` closes them all."""

    def close(self) -> None:
        for gen in self:
            gen.close()

    @property
    def completion_tokens(self) -> int:
        return sum(gen.completion_tokens for gen in self)


def start_choices(service, prompt, opts: GenOptions, n: int, **kw) -> Choices:
    """``n`` generations of ``prompt``, each with its own seed (``opts.seed + i``, from a random
    base when no seed is given, so unseeded choices differ); one that cannot start closes the
    ones already started and raises."""
    spec = guide_spec(opts.grammar, service.tokenizer, prompt)   # compiled once for every choice
    if n == 1:
        return Choices([start_generation(service, prompt, opts, spec, **kw)])
    base = secrets.randbits(62) if opts.seed is None else opts.seed
    out = Choices()
    try:
        for i in range(n):
            out.append(start_generation(service, prompt, dataclasses.replace(opts, seed=base + i), spec, **kw))
    except BaseException:
        out.close()
        raise
    return out


def start_generation(service, prompt, opts: GenOptions, spec: GuideSpec | None, *, metrics=None,
                     endpoint: str = "", t_arrival: float | None = None) -> Generation:
    """Budget check, submit, and wrap ``prompt`` (server/prompt.Prompt) under the constraint
    ``spec`` (``structured.guide_spec``). Raises RequestTooLong (413), QueueFull (429),
    InvalidRequest (400) from the engine; nothing has been sent to the client yet."""
    prompt_ids = prompt.ids
    n = len(prompt_ids)
    room = service.max_context - n
    if room < 1:
        raise RequestTooLong(
            f"the prompt is {n} tokens; this model's context is {service.max_context} tokens "
            f"(prompt plus output). Shorten the conversation.")
    # Clients (agents) often ask for more than fits; answer with what fits (finish "length").
    max_new = room if opts.max_tokens is None else min(opts.max_tokens, room)
    tok = service.tokenizer
    eos = tuple(tok.eos_token_ids)
    params = SamplingParams(
        max_new_tokens=max_new, temperature=opts.temperature, top_p=opts.top_p,
        top_k=opts.top_k, seed=opts.seed, stop_token_ids=() if opts.ignore_eos else eos,
        ignore_eos=opts.ignore_eos, logit_bias=opts.logit_bias, logprobs=opts.logprobs,
        guide=spec, presence_penalty=opts.presence_penalty,
        frequency_penalty=opts.frequency_penalty, repetition_penalty=opts.repetition_penalty,
        min_p=opts.min_p)
    handle = service.submit(list(prompt_ids), params)
    text = None if opts.logprobs is None else LogprobText(tok, service.vocab_size)
    # some formats' tags split reasoning from the answer: kept with or without tools
    keep = format_tags(prompt.style) if prompt.tools or prompt.style in ALWAYS_KEPT else ()
    return Generation(handle, tok, opts.stop, frozenset(eos), metrics, endpoint, t_arrival, text, keep)
