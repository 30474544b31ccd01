"""Shared plumbing for both protocols: parsed event streams, SSE framing, disconnects.

``parsed_events`` drives a ``Generation`` through an ``OutputParser`` (feeding the prompt's
pre-filled assistant text first) and yields parser events; streaming routes render each event
as it comes and buffered routes collect them. ``sse_response`` wraps an async iterator of
already-framed SSE strings; when the client goes away Starlette cancels the iterator, whose
``finally`` aborts the request in the engine. ``until_disconnect`` gives buffered (non-stream)
requests the same behaviour.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from .errors import is_anthropic
from .generation import Generation
from .parser import Event, output_parser
from .prompt import Prompt

log = logging.getLogger(__name__)


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def sse(data: dict | str, event: str | None = None) -> str:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                          separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {body}\n\n"


async def parsed_events(gen: Generation, prompt: Prompt) -> AsyncIterator[Event]:
    parser = output_parser(tools=prompt.tools, in_reasoning=prompt.in_reasoning, style=prompt.style,
                          schemas=prompt.schemas)
    for ev in parser.feed(prompt.prefill) if prompt.prefill else ():
        yield ev
    async for text in gen:
        for ev in parser.feed(text):
            yield ev
    for ev in parser.finish():
        yield ev


#: what a silent stream sends: Anthropic's own ``ping`` event; elsewhere an SSE comment, which
#: every SSE client skips
ANTHROPIC_PING = sse({"type": "ping"}, event="ping")
COMMENT_BEAT = ": keep-alive\n\n"


def sse_response(chunks: AsyncIterator[str], gen: Generation, request: Request) -> StreamingResponse:
    """Stream ``chunks``; while none comes for the config's ``heartbeat_s`` (a long prompt
    prefilling before the first token), send a heartbeat, so that proxies and agents with idle
    timeouts keep the request."""
    beat = ANTHROPIC_PING if is_anthropic(request.url.path) else COMMENT_BEAT
    every_s = request.app.state.config.heartbeat_s

    async def guarded():
        try:
            async for chunk in with_heartbeat(chunks, beat, every_s):
                yield chunk
        finally:
            gen.close()
    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def with_heartbeat(chunks: AsyncIterator[str], beat: str, every_s: float) -> AsyncIterator[str]:
    """``chunks`` as they come, and ``beat`` each time none has come for ``every_s``. One task
    reads ``chunks`` into a queue (a timeout must not cancel the read itself); a chunk already
    waiting is taken without arming a timer."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump():
        try:
            async for chunk in chunks:
                queue.put_nowait(chunk)
        finally:
            queue.put_nowait(end)
    task = asyncio.create_task(pump())
    try:
        while True:
            try:
                chunk = queue.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    async with asyncio.timeout(every_s):
                        chunk = await queue.get()
                except TimeoutError:
                    yield beat
                    continue
            if chunk is end:
                await task                  # the reader's exception, if it failed
                return
            yield chunk
    finally:
        task.cancel()


async def until_disconnect(request: Request, work: Awaitable, gen: Generation, poll_s=0.02):
    """Await ``work``; if the client disconnects first, abort the request and answer 499
    (nginx's "client closed request"; nobody reads it, the access log and metrics do).

    ``poll_s``: how often the (cheap, non-blocking) disconnect check runs. The CPU decode of a
    small model now runs at thousands of tokens/s, so a 250 ms poll let an abandoned request
    generate hundreds of tokens before it was aborted; 20 ms bounds that waste."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                gen.close()
                return Response(status_code=499)
    finally:
        if not task.done():
            task.cancel()
        gen.close()
