"""OpenAI Responses API: ``POST /v1/responses`` (what Codex and other recent agents speak).

The answer is a list of output items in the order the model wrote them: ``reasoning`` (its text
as ``reasoning_text`` content), ``message`` (``output_text``), ``function_call`` (``call_id``,
``name``, ``namespace`` for a namespace's tool, ``arguments`` as a JSON string) and
``custom_tool_call`` (``input``: the text the model wrote for a custom tool). ``status`` is
``completed``, or ``incomplete`` with ``incomplete_details.reason = "max_output_tokens"`` when
the token limit cut it. ``usage``
counts ``input_tokens`` (``cached_tokens`` from the prefix cache), ``output_tokens`` and, of
those, the reasoning's tokens.

Streaming follows OpenAI's event sequence, each event an SSE ``event:`` with a
``sequence_number``: ``response.created``, ``response.in_progress``; per item
``response.output_item.added``, for text ``response.content_part.added``, the deltas
(``response.output_text.delta``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``; a custom tool's input as one
``response.custom_tool_call_input.delta`` once the call is complete), their ``.done`` events and
``response.output_item.done``; last ``response.completed`` (or ``response.incomplete``) with
the whole response. A failure in the engine mid-stream is an ``error`` event. Nothing is stored
(``store`` is always false): ``responses_schema`` says what that refuses.
"""
from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, Request

from .auth import require_api_key
from .deps import begin, served_name
from .generation import Generation
from .parser import Content, Event, Reasoning, ToolArgs, ToolEnd, ToolStart
from .prompt import Prompt, build_prompt
from .responses_schema import NamedChoice, ResponsesRequest, ToolSet
from .streaming import new_id, parsed_events, sse, sse_response, until_disconnect

router = APIRouter(dependencies=[Depends(require_api_key)])

#: an open text item's type -> (its content part's type, the delta event's name)
_TEXT = {"message": ("output_text", "response.output_text"),
         "reasoning": ("reasoning_text", "response.reasoning_text")}


class OutputItems:
    """Builds the output items from parser events, and the stream events that describe each
    step (a non-streaming request builds the same items and drops the events)."""

    def __init__(self, tools: ToolSet, gen: Generation | None = None) -> None:
        self.gen = gen if gen is not None and gen.logprob_text is not None else None   # log-probabilities asked for
        self.items: list[dict] = []
        self.seq = 0
        self.tools = tools
        self._index: dict[str, int] = {}       # an item's id -> its output index
        self._open: dict | None = None         # the reasoning or message item receiving text
        self._calls: dict[int, dict] = {}      # the parser's tool-call index -> its item
        self._raw: dict[int, str] = {}         # a custom tool call's arguments so far

    def event(self, kind: str, **body) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **body}
        self.seq += 1
        return ev

    def feed(self, ev: Event) -> list[dict]:
        # the tokens' log-probabilities since the last event: the message's text keeps them
        taken = self.gen.take_logprobs() if self.gen is not None else []
        if isinstance(ev, (Reasoning, Content)):
            return self._text("reasoning" if isinstance(ev, Reasoning) else "message", ev.text, taken)
        if isinstance(ev, ToolStart):
            return self.close() + [self._added(self._call(ev))]
        item = self._calls[ev.index]
        where = {"item_id": item["id"], "output_index": self._index[item["id"]]}
        custom = item["type"] == "custom_tool_call"
        if isinstance(ev, ToolArgs):
            if custom:                          # its input is known once its JSON is whole
                self._raw[ev.index] += ev.text
                return []
            item["arguments"] += ev.text
            return [self.event("response.function_call_arguments.delta", **where, delta=ev.text)]
        assert isinstance(ev, ToolEnd)
        item["status"] = "completed"
        if custom:
            item["input"] = _custom_input(self._raw.pop(ev.index))
            done = [self.event("response.custom_tool_call_input.delta", **where, delta=item["input"]),
                    self.event("response.custom_tool_call_input.done", **where, input=item["input"])]
        else:
            done = [self.event("response.function_call_arguments.done", **where, name=item["name"],
                               arguments=item["arguments"])]
        return done + [self.event("response.output_item.done", output_index=where["output_index"], item=dict(item))]

    def _call(self, ev: ToolStart) -> dict:
        """The item of a call the model opened, by what the tool it names is (a name the request
        did not give: a function call under that name)."""
        kind, namespace, name = self.tools.kinds.get(ev.name, ("function", None, ev.name))
        item = {"type": "custom_tool_call" if kind == "custom" else "function_call",
                "id": new_id("ctc_" if kind == "custom" else "fc_"), "call_id": new_id("call_"), "name": name}
        if namespace:
            item["namespace"] = namespace
        if kind == "custom":
            item["input"], self._raw[ev.index] = "", ""
        else:
            item["arguments"] = ""
        item["status"] = "in_progress"
        self._calls[ev.index] = item
        return item

    def close(self, status: str = "completed") -> list[dict]:
        """Finish the open text item, if any (``status``: ``incomplete`` when the limit cut it)."""
        item, self._open = self._open, None
        if item is None:
            return []
        part, name = item["content"][0], _TEXT[item["type"]][1]
        if "logprobs" in part and self.gen is not None:
            part["logprobs"] += self.gen.take_logprobs()
        where = {"item_id": item["id"], "output_index": self._index[item["id"]], "content_index": 0}
        item["status"] = status
        return [self.event(f"{name}.done", **where, text=part["text"]),
                self.event("response.content_part.done", **where, part=dict(part)),
                self.event("response.output_item.done", output_index=where["output_index"],
                           item=dict(item, content=[dict(part)]))]

    def _added(self, item: dict) -> dict:
        self._index[item["id"]] = len(self.items)
        self.items.append(item)
        return self.event("response.output_item.added", output_index=len(self.items) - 1,
                          item=dict(item, content=[]) if "content" in item else dict(item))

    def _text(self, kind: str, text: str, logprobs: list[dict]) -> list[dict]:
        out = []
        part_type, name = _TEXT[kind]
        if self._open is None or self._open["type"] != kind:
            out += self.close()
            item = {"type": kind, "id": new_id("msg_" if kind == "message" else "rs_"), "status": "in_progress",
                    "content": []}
            if kind == "message":
                item["role"] = "assistant"
            else:
                item["summary"] = []
            out.append(self._added(item))
            part = {"type": part_type, "text": ""}
            if kind == "message":
                part["annotations"], part["logprobs"] = [], []
            item["content"].append(part)
            self._open = item
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=len(self.items) - 1, content_index=0, part=dict(part)))
        item = self._open
        item["content"][0]["text"] += text
        delta = {"item_id": item["id"], "output_index": self._index[item["id"]], "content_index": 0, "delta": text}
        if kind == "message":
            delta["logprobs"] = logprobs
            item["content"][0]["logprobs"] += logprobs
        return out + [self.event(f"{name}.delta", **delta)]


def _custom_input(raw: str) -> str:
    """A custom tool's text from the ``{"input": ...}`` the model wrote; other JSON, or none,
    is kept as the model wrote it (nothing is lost)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    if isinstance(value, dict) and isinstance(value.get("input"), str) and len(value) == 1:
        return value["input"]
    return raw


def _response(head: tuple[str, int, str], body: ResponsesRequest, items: OutputItems,
              gen: Generation | None, tokenizer) -> dict:
    """The response object; ``gen`` None: the first snapshot, still in progress."""
    (rid, created, model), choice = head, body.tool_choice
    out = {"id": rid, "object": "response", "created_at": created, "model": model,
           "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
           "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
           "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
           "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
           "store": False, "temperature": 1.0 if body.temperature is None else body.temperature,
           "top_p": 1.0 if body.top_p is None else body.top_p, "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
           "tool_choice": choice.model_dump() if isinstance(choice, NamedChoice) else (choice or "auto"),
           "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
           "truncation": "disabled", "usage": None, "metadata": body.metadata or {}}
    if gen is None:
        return out
    cut = gen.finish_reason == "length"
    reasoning = "".join(p["text"] for i in items.items if i["type"] == "reasoning" for p in i["content"])
    n_reasoning = len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    out.update(status="incomplete" if cut else "completed", output=items.items,
               incomplete_details={"reason": "max_output_tokens"} if cut else None,
               usage={"input_tokens": gen.prompt_tokens, "input_tokens_details": {"cached_tokens": gen.cached_tokens},
                      "output_tokens": gen.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": min(n_reasoning, gen.completion_tokens)},
                      "total_tokens": gen.prompt_tokens + gen.completion_tokens})
    return out


def _prompt(svc, body: ResponsesRequest) -> Prompt:
    choice = body.tool_choice
    named = choice.name if isinstance(choice, NamedChoice) else None
    mode = "auto" if choice is None or named else choice
    return build_prompt(svc.tokenizer, body.template_messages(), body.tool_set.template or None,
                        tool_choice=mode, named_tool=named, template_kwargs=body.template_kwargs(),
                        parallel_calls=body.parallel_tool_calls is not False)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    svc, prompt, gen = begin(request, body, "responses", _prompt, body.options())
    head = (new_id("resp_"), int(time.time()), served_name(request))
    if body.stream:
        return sse_response(_stream(gen, prompt, head, body, svc.tokenizer), gen, request)
    return await until_disconnect(request, _full(gen, prompt, head, body, svc.tokenizer), gen)


async def _full(gen: Generation, prompt: Prompt, head: tuple, body: ResponsesRequest, tokenizer) -> dict:
    items = OutputItems(body.tool_set, gen)
    async for ev in parsed_events(gen, prompt):
        items.feed(ev)
    items.close("incomplete" if gen.finish_reason == "length" else "completed")
    return _response(head, body, items, gen, tokenizer)


async def _stream(gen: Generation, prompt: Prompt, head: tuple, body: ResponsesRequest, tokenizer):
    items = OutputItems(body.tool_set, gen)

    def framed(ev: dict) -> str:
        return sse(ev, event=ev["type"])

    first = _response(head, body, items, None, tokenizer)
    yield framed(items.event("response.created", response=first))
    yield framed(items.event("response.in_progress", response=first))
    try:
        async for ev in parsed_events(gen, prompt):
            for out in items.feed(ev):
                yield framed(out)
    except Exception as exc:   # the engine failed mid-stream: tell the client in-band
        yield framed(items.event("error", code="generation_failed", message=f"generation failed: {exc}",
                                 param=None))
        return
    for out in items.close("incomplete" if gen.finish_reason == "length" else "completed"):
        yield framed(out)
    final = _response(head, body, items, gen, tokenizer)
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield framed(items.event(kind, response=final))
