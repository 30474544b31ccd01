"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Chat streaming follows OpenAI's chunk sequence: a first chunk with ``role``, then
``content`` / ``reasoning_content`` deltas, tool calls as ``delta.tool_calls`` (index, id,
name with empty arguments, then argument fragments), a last chunk with ``finish_reason``
(``stop``, ``length`` or ``tool_calls``), with ``stream_options.include_usage`` a usage chunk
with empty ``choices``, then ``data: [DONE]``. ``usage.prompt_tokens_details.cached_tokens``
reports the prompt tokens served from the prefix cache.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request

from .auth import require_api_key
from .deps import begin_choices, check_model, served_name
from .errors import ApiError, error_body
from .generation import Choices, Generation
from .openai_schema import ChatMessage, ChatRequest, CompletionRequest, NamedToolChoice
from .parser import Content, Reasoning, ToolArgs, ToolStart
from .prompt import EFFORTS, Prompt, arguments_object, build_prompt, check_tool_schema, encode_text
from .structured import completion_logprobs
from .tool_turns import OPENAI, check_tool_turns
from .streaming import new_id, parsed_events, sse, sse_response, until_disconnect

router = APIRouter(dependencies=[Depends(require_api_key)])


def to_template_messages(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"{where}.content.{j}: only text parts are supported, "
                                        f"got type '{part.type}'", param=f"{where}.content")
                texts.append(part.text)
            content = "".join(texts)
        msg: dict = {"role": "system" if m.role == "developer" else m.role,
                     "content": content or ""}
        if m.role == "tool":
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name:
                msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": tc.id or new_id("call_"), "type": "function",
                 "function": {"name": tc.function.name, "arguments": arguments_object(
                     tc.function.arguments, f"{where}.tool_calls.{k}.function")}}
                for k, tc in enumerate(m.tool_calls)]
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    check_tool_turns(out, [f"messages.{i}" for i in range(len(out))], OPENAI)
    return out


def usage(gens: Choices) -> dict:
    """One prompt (counted once), every choice's output."""
    first, out = gens[0], gens.completion_tokens
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": out,
            "total_tokens": first.prompt_tokens + out,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


async def merged(streams: list[AsyncIterator]) -> AsyncIterator:
    """The items of several async iterators as they come (a request's ``n`` choices); the first
    failure is raised here, and closing this closes them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(end)
        except Exception as exc:  # noqa: BLE001  raised in the consumer
            await queue.put(exc)
    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        for _ in tasks:
            while (item := await queue.get()) is not end:
                if isinstance(item, Exception):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()


def finish(gen: Generation, tool_calls: int) -> str:
    reason = "length" if gen.finish_reason == "length" else "stop"
    return "tool_calls" if tool_calls and reason == "stop" else reason


def chat_prompt(svc, body: ChatRequest) -> Prompt:
    tools = None
    if body.tools:
        for k, t in enumerate(body.tools):
            if t.function.parameters is not None:
                check_tool_schema(t.function.name, t.function.parameters, f"tools.{k}.function")
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
    choice = body.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort in ("none", "minimal"):
        kwargs.setdefault("enable_thinking", False)
    elif body.reasoning_effort in EFFORTS:          # gpt-oss's template reads it (others ignore it)
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    mode = "auto" if choice is None or named else choice
    return build_prompt(svc.tokenizer, to_template_messages(body.messages), tools,
                        tool_choice=mode, named_tool=named, template_kwargs=kwargs,
                        parallel_calls=body.parallel_tool_calls is not False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    _, prompt, gens = begin_choices(request, body, "chat", chat_prompt, body.chat_options(), body.n or 1)
    cid, created, model = new_id("chatcmpl-"), int(time.time()), served_name(request)
    if body.stream:
        return sse_response(_chat_stream(gens, prompt, cid, created, model, body.include_usage),
                            gens, request)
    return await until_disconnect(request, _chat_full(gens, prompt, cid, created, model), gens)


async def _chat_full(gens: Choices, prompt, cid, created, model) -> dict:
    choices = await asyncio.gather(*(_chat_choice(gen, prompt, i) for i, gen in enumerate(gens)))
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": list(choices), "usage": usage(gens)}


async def _chat_choice(gen: Generation, prompt, index: int) -> dict:
    content, reasoning, calls = [], [], []
    async for ev in parsed_events(gen, prompt):
        if isinstance(ev, Content):
            content.append(ev.text)
        elif isinstance(ev, Reasoning):
            reasoning.append(ev.text)
        elif isinstance(ev, ToolStart):
            calls.append({"id": new_id("call_"), "type": "function",
                          "function": {"name": ev.name, "arguments": ""}})
        elif isinstance(ev, ToolArgs):
            calls[ev.index]["function"]["arguments"] += ev.text
    message = {"role": "assistant", "content": "".join(content) if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return {"index": index, "message": message, "logprobs": _chat_logprobs(gen),
            "finish_reason": finish(gen, len(calls))}


def _chat_logprobs(gen: Generation) -> dict | None:
    """OpenAI chat's ``logprobs`` for the tokens not yet reported (None when not asked for)."""
    if gen.logprob_text is None:
        return None
    return {"content": gen.take_logprobs(), "refusal": None}


async def _choice_deltas(gen: Generation, prompt, index: int):
    """One choice's stream: (index, delta, finish reason or None)."""
    yield index, {"role": "assistant", "content": ""}, None
    n_calls = 0
    async for ev in parsed_events(gen, prompt):
        if isinstance(ev, Content):
            yield index, {"content": ev.text}, None
        elif isinstance(ev, Reasoning):
            yield index, {"reasoning_content": ev.text}, None
        elif isinstance(ev, ToolStart):
            n_calls += 1
            yield index, {"tool_calls": [{"index": ev.index, "id": new_id("call_"), "type": "function",
                                          "function": {"name": ev.name, "arguments": ""}}]}, None
        elif isinstance(ev, ToolArgs):
            yield index, {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}, None
    yield index, {}, finish(gen, n_calls)


async def _chat_stream(gens: Choices, prompt, cid, created, model, include_usage):
    def chunk(index: int, delta: dict, reason=None) -> str:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": _chat_logprobs(gens[index]),
                             "finish_reason": reason}]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    try:
        async for index, delta, reason in merged([_choice_deltas(g, prompt, i) for i, g in enumerate(gens)]):
            yield chunk(index, delta, reason)
    except Exception as exc:   # the engine failed mid-stream: tell the client in-band
        yield sse(error_body("/v1/chat/completions", 500, f"generation failed: {exc}"))
        return
    if include_usage:
        yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                   "model": model, "choices": [], "usage": usage(gens)})
    yield sse("[DONE]")


def completion_prompt(svc, body: CompletionRequest) -> Prompt:
    """The prompt's ids as given (text encoded with the tokenizer's special tokens); nothing to
    parse in the output."""
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        ids = list(encode_text(svc.tokenizer, p, add_special_tokens=True, param="prompt"))
    else:
        ids = list(p)       # the engine checks them against the model's vocabulary (400)
    if not ids:
        raise ApiError(400, "prompt: the prompt is empty", param="prompt")
    return Prompt(ids=ids, in_reasoning=False, prefill="", tools=False)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    _, _, gens = begin_choices(request, body, "completions", completion_prompt,
                               body.options(body.max_tokens, body.logprobs), body.n or 1)
    cid, created, model = new_id("cmpl-"), int(time.time()), served_name(request)
    if body.stream:
        return sse_response(_text_stream(gens, cid, created, model, body.include_usage), gens, request)

    async def choice(gen: Generation, index: int) -> dict:
        text = "".join([t async for t in gen])
        return {"index": index, "text": text, "logprobs": _text_logprobs(gen), "finish_reason": finish(gen, 0)}

    async def full() -> dict:
        choices = await asyncio.gather(*(choice(gen, i) for i, gen in enumerate(gens)))
        return {"id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": list(choices), "usage": usage(gens)}
    return await until_disconnect(request, full(), gens)


def _text_logprobs(gen: Generation) -> dict | None:
    return None if gen.logprob_text is None else completion_logprobs(gen.take_logprobs())


async def _text_pieces(gen: Generation, index: int):
    async for text in gen:
        yield index, text, None
    yield index, "", finish(gen, 0)


async def _text_stream(gens: Choices, cid, created, model, include_usage):
    def chunk(index: int, text: str, reason=None) -> str:
        body = {"id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": index, "text": text, "logprobs": _text_logprobs(gens[index]),
                             "finish_reason": reason}]}
        if include_usage:
            body["usage"] = None
        return sse(body)
    try:
        async for index, text, reason in merged([_text_pieces(g, i) for i, g in enumerate(gens)]):
            yield chunk(index, text, reason)
    except Exception as exc:
        yield sse(error_body("/v1/completions", 500, f"generation failed: {exc}"))
        return
    if include_usage:
        yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": usage(gens)})
    yield sse("[DONE]")


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_model_card(request)], "has_more": False,
            "first_id": served_name(request), "last_id": served_name(request)}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    check_model(request, model_id)
    return _model_card(request)


def _model_card(request: Request) -> dict:
    """One entry readable by both clients (OpenAI ``Model`` and Anthropic ``ModelInfo``)."""
    started = request.app.state.started
    card = {"id": served_name(request), "object": "model", "created": int(started),
            "owned_by": "freetoken", "type": "model", "display_name": served_name(request),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}
    svc = request.app.state.service
    if svc.health().get("status") == "ok":
        card["max_model_len"] = svc.max_context
    return card
