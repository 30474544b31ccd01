"""``Request``: one generation inside the scheduler, and the events it streams back.

Owned by the scheduler thread after ``submit``; the HTTP side only reads ``prompt_tokens`` /
``cached_tokens`` and consumes ``TokenEvent``s through its ``RequestHandle``.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from ..executor.guide import Guide
from ..executor.mtp import MtpSequence
from ..executor.penalties import Penalties
from ..executor.sampler import SamplingParams
from ..executor.speculate import SequenceDrafts

_ids = itertools.count()


@dataclass(frozen=True)
class TokenEvent:
    token_id: int | None          # None on a final event without a token (abort)
    finish_reason: str | None     # None | "stop" | "length" | "abort"
    error: Exception | None = None  # why the engine aborted (an EngineError), None if asked to
    logprob: tuple | None = None  # with params.logprobs: (log-probability, ((id, log-probability), ...))


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    stop_ids: frozenset[int]
    max_new_tokens: int
    sink: "RequestHandle"
    guide: Guide | None = None    # the grammar the output follows (sampled under its mask)
    penalties: Penalties | None = None   # repetition penalties' running counts
    id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0             # tokens whose KV is in ``blocks``
    shared: int = 0               # the prompt's full blocks put in the prefix tree so far
    state: int = -1               # hybrid models: the recurrent-state slot (cache/states.py)
    anchor_plan: list[int] = field(default_factory=list)   # prompt positions to checkpoint the state at
    drafting: SequenceDrafts | MtpSequence | None = None   # its drafts' state (n-gram: made at its first draft)
    draft: list[int] = field(default_factory=list)   # this step's draft tokens (scheduler/drafts.py)
    scratch: list[int] = field(default_factory=list)   # hybrid models: their state snapshot slots
    cached_tokens: int = 0        # of the prompt, reused from the prefix tree
    finished: bool = False
    aborted: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None

    @property
    def tokens(self) -> list[int]:
        """Every token whose KV the request needs: prompt, then generated output."""
        return self.prompt_ids + self.output_ids

    @property
    def pending(self) -> int:
        """Tokens to run before the next sample (prompt remainder, or the last sampled token)."""
        return len(self.tokens) - self.computed


class RequestHandle:
    """What ``EngineService.submit`` returns: iterate it (async, or sync with ``events()``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None):
        self._loop = loop
        self._aq: asyncio.Queue | None = asyncio.Queue() if loop else None
        self._q: queue.Queue | None = None if loop else queue.Queue()
        self.request: Request | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.done = False
        self._abort_cb = None

    # called from the scheduler thread
    def push(self, event: TokenEvent) -> None:
        if self._aq is not None:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, event)
            except RuntimeError:      # the client's loop is gone: nobody is listening
                pass
        else:
            self._q.put(event)

    def abort(self) -> None:
        """Stop the request and free its KV at the next scheduler step; harmless when finished."""
        if self._abort_cb is not None:
            self._abort_cb()

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        if self.done:
            raise StopAsyncIteration
        ev = await self._aq.get()
        if ev.finish_reason is not None:
            self.done = True
        return ev

    def events(self):
        """Synchronous iteration (for handles created outside an event loop)."""
        while not self.done:
            ev = self._q.get()
            if ev.finish_reason is not None:
                self.done = True
            yield ev
