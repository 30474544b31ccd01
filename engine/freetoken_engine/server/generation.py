"""One request's run through the EngineService, as text, for both protocol modules.

``start_generation`` tokenizes nothing: it takes prompt ids, checks the context budget, submits
to the service (so 413 / 429 / 400 are raised *before* any response is started) and returns a
``Generation``. Iterating it yields decoded text pieces with stop strings applied; afterwards
``finish_reason`` is ``"stop"`` (EOS or a stop string) or ``"length"``, and the token counts
are final. An abort the server did not ask for raises ``ApiError(503)``. ``close()`` aborts
the request in the engine (client disconnect, stop string) and is idempotent; the protocol
modules call it in ``finally``.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from ..errors import RequestTooLong
from ..executor.sampler import SamplingParams
from .errors import ApiError
from .stops import StopMatcher

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


class Generation:
    """Async iterator of text pieces for one submitted request (see the module docstring)."""

    def __init__(self, handle, tokenizer, stops: Sequence[str], skip_ids: frozenset[int],
                 metrics=None, endpoint: str = "", t_arrival: float | None = None):
        self.handle = handle
        self.decoder = tokenizer.stream_decoder()
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
            async for ev in self.handle:
                text = ""
                if ev.token_id is not None:      # a final event may carry no token (abort)
                    self.completion_tokens += 1
                    if self.t_first is None:
                        self.t_first = time.monotonic()
                    if ev.token_id not in self.skip_ids:
                        text = self.decoder.step(ev.token_id)
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

    def close(self) -> None:
        """Abort in the engine if still running; record metrics once."""
        if self._closed:
            return
        self._closed = True
        if self.finish_reason is None or self.matcher.stopped:
            self.handle.abort()
        if self.metrics is not None:
            self.metrics.observe_generation(self)


def start_generation(service, prompt_ids: list[int], opts: GenOptions, *, metrics=None,
                     endpoint: str = "", t_arrival: float | None = None) -> Generation:
    """Budget check, submit, and wrap. Raises RequestTooLong (413), QueueFull (429),
    InvalidRequest (400) from the engine; nothing has been sent to the client yet."""
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
        ignore_eos=opts.ignore_eos)
    handle = service.submit(list(prompt_ids), params)
    return Generation(handle, tok, opts.stop, frozenset(eos), metrics, endpoint, t_arrival)
