"""Anthropic-compatible routes: ``/v1/messages`` and ``/v1/messages/count_tokens``.

Streaming follows Anthropic's event sequence: ``message_start``, then per content block
``content_block_start`` / ``content_block_delta`` (``thinking_delta``, ``text_delta``,
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (``stop_reason``:
``end_turn``, ``max_tokens``, ``stop_sequence`` or ``tool_use``; cumulative usage) and
``message_stop``. A tool's ``input`` is sent as one ``input_json_delta`` when the call is
complete and validated (the block itself starts as soon as the name is known), because the
clients parse partial JSON as it arrives. ``usage.cache_read_input_tokens`` is the prompt
served from the prefix cache and ``input_tokens`` the rest (Anthropic's accounting).
"""
from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request

from .anthropic_schema import CountRequest, MessagesRequest
from .auth import require_api_key
from .deps import begin, check_model, ready_service, served_name
from .errors import error_body
from .generation import Generation
from .parser import Content, Reasoning, ToolArgs, ToolEnd, ToolStart
from .prompt import Prompt, build_prompt
from .streaming import new_id, parsed_events, sse, sse_response, until_disconnect

router = APIRouter(dependencies=[Depends(require_api_key)])


def _prompt(svc, body: CountRequest) -> Prompt:
    mode, named = body.choice()
    messages = body.template_messages()
    prefill = ""
    if len(messages) > 1 and messages[-1]["role"] == "assistant" \
            and not messages[-1].get("tool_calls"):
        prefill = messages.pop()["content"]   # Anthropic pre-fill: the answer continues it
    return build_prompt(svc.tokenizer, messages, body.template_tools(), tool_choice=mode,
                        named_tool=named, template_kwargs=body.template_kwargs(),
                        continue_text=prefill, parallel_calls=body.parallel_calls())


def _usage(gen: Generation, *, n_prompt: int) -> dict:
    cached = gen.cached_tokens
    prompt = gen.prompt_tokens or n_prompt
    return {"input_tokens": prompt - cached, "output_tokens": gen.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _stop(gen: Generation, tool_calls: int) -> tuple[str, str | None]:
    if gen.finish_reason == "length":
        return "max_tokens", None
    if gen.stop_string is not None:
        return "stop_sequence", gen.stop_string
    return ("tool_use" if tool_calls else "end_turn"), None


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountRequest, request: Request):
    svc = ready_service(request)
    check_model(request, body.model)
    return {"input_tokens": len(_prompt(svc, body).ids)}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    _, prompt, gen = begin(request, body, "messages", _prompt, body.options())
    mid, model = new_id("msg_"), served_name(request)
    if body.stream:
        return sse_response(_stream(gen, prompt, mid, model), gen, request)
    return await until_disconnect(request, _full(gen, prompt, mid, model), gen)


def _message(mid: str, model: str, content: list, stop=(None, None), usage=None) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": usage or {"input_tokens": 0, "output_tokens": 0}}


async def _full(gen: Generation, prompt: Prompt, mid: str, model: str) -> dict:
    blocks: list[dict] = []
    args: dict[int, list[str]] = {}
    n_tools = 0
    async for ev in parsed_events(gen, prompt):
        last = blocks[-1] if blocks else None
        if isinstance(ev, Reasoning):
            if last is None or last["type"] != "thinking":
                blocks.append(last := {"type": "thinking", "thinking": "", "signature": ""})
            last["thinking"] += ev.text
        elif isinstance(ev, Content):
            if last is None or last["type"] != "text":
                blocks.append(last := {"type": "text", "text": ""})
            last["text"] += ev.text
        elif isinstance(ev, ToolStart):
            n_tools += 1
            args[ev.index] = []
            blocks.append({"type": "tool_use", "id": new_id("toolu_"), "name": ev.name,
                           "input": {}, "_index": ev.index})
        elif isinstance(ev, ToolArgs):
            args[ev.index].append(ev.text)
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = _input_object("".join(args[b.pop("_index")]))
    return _message(mid, model, blocks, _stop(gen, n_tools),
                    _usage(gen, n_prompt=len(prompt.ids)))


def _input_object(raw: str) -> dict:
    """Anthropic's ``input`` must be an object; a model's malformed JSON is kept as text."""
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {"_raw": raw}
    return value if isinstance(value, dict) else {"_value": value}


async def _stream(gen: Generation, prompt: Prompt, mid: str, model: str):
    n_prompt = len(prompt.ids)
    start = _message(mid, model, [], usage={"input_tokens": n_prompt, "output_tokens": 0,
                                            "cache_read_input_tokens": 0,
                                            "cache_creation_input_tokens": 0})
    yield sse({"type": "message_start", "message": start}, "message_start")
    index, kind, n_tools = -1, None, 0
    args: list[str] = []

    def open_block(block: dict):
        return sse({"type": "content_block_start", "index": index, "content_block": block},
                   "content_block_start")

    def close_block():
        out = ""
        if kind == "thinking":
            out += sse({"type": "content_block_delta", "index": index,
                        "delta": {"type": "signature_delta", "signature": ""}},
                       "content_block_delta")
        return out + sse({"type": "content_block_stop", "index": index}, "content_block_stop")

    def delta(d: dict):
        return sse({"type": "content_block_delta", "index": index, "delta": d},
                   "content_block_delta")
    try:
        async for ev in parsed_events(gen, prompt):
            if isinstance(ev, (Reasoning, Content)):
                want = "thinking" if isinstance(ev, Reasoning) else "text"
                if kind != want:
                    if kind is not None:
                        yield close_block()
                    index, kind = index + 1, want
                    yield open_block({"type": "thinking", "thinking": "", "signature": ""}
                                     if want == "thinking" else {"type": "text", "text": ""})
                yield delta({"type": "thinking_delta", "thinking": ev.text} if want == "thinking"
                            else {"type": "text_delta", "text": ev.text})
            elif isinstance(ev, ToolStart):
                if kind is not None:
                    yield close_block()
                index, kind, n_tools = index + 1, "tool_use", n_tools + 1
                yield open_block({"type": "tool_use", "id": new_id("toolu_"), "name": ev.name,
                                  "input": {}})
            elif isinstance(ev, ToolArgs):
                args.append(ev.text)
            elif isinstance(ev, ToolEnd):
                # one validated input_json_delta per tool: clients parse the partial JSON as it
                # arrives and a model's malformed arguments would break them mid-stream
                whole = json.dumps(_input_object("".join(args)), ensure_ascii=False)
                args.clear()
                yield delta({"type": "input_json_delta", "partial_json": whole})
                yield close_block()
                kind = None
    except Exception as exc:  # the engine failed mid-stream: Anthropic's in-band error event
        yield sse(error_body("/v1/messages", 500, f"generation failed: {exc}"), "error")
        return
    if kind is not None:
        yield close_block()
    reason, seq = _stop(gen, n_tools)
    yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
               "usage": _usage(gen, n_prompt=n_prompt)}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
