"""``ScriptedService``: the EngineService interface with an answer fixed by the test.

A random tiny checkpoint never writes ``<tool_call>`` or ``<think>``, so the tests of how the
server renders tool calls and reasoning need a model whose output is known. This service keeps
everything else real: the checkpoint's tokenizer and chat template encode the prompt, the
answer is encoded to token ids and streamed back as ``TokenEvent``s through the same
``RequestHandle`` the scheduler uses, ending with EOS. It also lets tests set ``health_state``
(loading / error), which a real load passes through too quickly to observe.
"""
from __future__ import annotations

import asyncio
import json
import contextlib
import threading

from freetoken_engine.errors import RequestTooLong
from freetoken_engine.scheduler.request import RequestHandle, TokenEvent


class ScriptedService:
    model_name = "tiny"

    def __init__(self, tokenizer, script=lambda prompt: "", max_context: int = 512,
                 delay_s: float = 0.0):
        self.tokenizer, self.script = tokenizer, script
        self.max_context, self.delay_s = max_context, delay_s
        self.health_state = {"status": "ok", "progress": 1.0, "error": None}
        self.capacity = 8

    def health(self) -> dict:
        return dict(self.health_state)

    def submit(self, prompt_ids, params) -> RequestHandle:
        if len(prompt_ids) + params.max_new_tokens > self.max_context:
            raise RequestTooLong(f"{len(prompt_ids)} + {params.max_new_tokens} tokens exceed "
                                 f"the context of {self.max_context}")
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        answer = self.tokenizer.encode(self.script(prompt), add_special_tokens=False)
        answer = (answer + [self.tokenizer.eos_token_ids[0]])[: params.max_new_tokens]
        handle = RequestHandle(asyncio.get_running_loop())
        handle.prompt_tokens = len(prompt_ids)
        stop = threading.Event()
        handle._abort_cb = stop.set

        def produce():
            for i, tok in enumerate(answer):
                if stop.wait(self.delay_s):
                    handle.push(TokenEvent(None, "abort"))
                    return
                last = i == len(answer) - 1
                reason = ("stop" if tok in self.tokenizer.eos_token_ids
                          else "length" if last else None)
                handle.push(TokenEvent(tok, reason))
        threading.Thread(target=produce, daemon=True).start()
        return handle

    def cache_stats(self) -> dict:
        return {"expert_cache": {"capacity_experts": self.capacity, "capacity_bytes": 0,
                                 "expert_bytes": 0, "min_experts": 1, "max_experts": 8,
                                 "hits": 0, "misses": 0, "fills": 0, "cpu_computed": 0,
                                 "fill_fraction": 1.0},
                "kv": {"blocks_total": 0, "blocks_used": 0, "block_size": 16},
                "device": "cpu", "device_bytes": 0}

    def stats(self) -> dict:
        return {"running": 0, "queued": 0}

    def shutdown(self) -> None:
        pass


def answered(messages: list[dict], reply, result: str) -> list[dict]:
    """``messages``, then the assistant's ``reply`` (an OpenAI client's message with tool calls)
    and a tool message answering each of its calls with ``result``: the next turn's history."""
    calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for c in reply.tool_calls]
    return [*messages, {"role": "assistant", "content": reply.content, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": c["id"], "content": result} for c in calls)]


@contextlib.contextmanager
def recording_server(tokenizer, answers, max_context: int = 512):
    """A live server over a ``ScriptedService`` of ``tokenizer`` that answers ``answers(prompt)``;
    the server it yields lists every prompt it was given, in order, in ``prompts``."""
    from live import live_server
    prompts: list[str] = []

    def script(prompt: str) -> str:
        prompts.append(prompt)
        return answers(prompt)
    with live_server(ScriptedService(tokenizer, script=script, max_context=max_context)) as srv:
        srv.prompts = prompts
        yield srv


def tool_uses(srv, messages: list[dict], tools: list[dict]) -> list[tuple[str, dict]]:
    """(name, input) of each tool_use block of an Anthropic answer, which must stop for them."""
    m = srv.anthropic().messages.create(model=srv.model, max_tokens=1000, messages=messages, tools=tools)
    assert m.stop_reason == "tool_use"
    return [(b.name, b.input) for b in m.content if b.type == "tool_use"]


def check_forced_calls(srv, messages: list[dict], tools: list[dict], named_prompt_end: str) -> None:
    """``tool_choice`` naming get_weather: the prompt ends with its pre-fill ``named_prompt_end``
    and the script's rest gives {"city": "Rome", "days": 1}; ``required``: the script's one
    call, search for "umbrellas"."""
    client = srv.openai()
    r = client.chat.completions.create(model=srv.model, messages=messages, tools=tools,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert srv.prompts[-1].endswith(named_prompt_end)
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Rome", "days": 1}
    r = client.chat.completions.create(model=srv.model, messages=messages, tools=tools, tool_choice="required")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls] == [
        ("search", {"query": "umbrellas"})]


def chat_calls(srv, messages: list[dict], tools: list[dict]):
    """An OpenAI chat answer, which must finish for its tool calls: (its message, each call as
    (name, parsed arguments))."""
    r = srv.openai().chat.completions.create(model=srv.model, messages=messages, tools=tools)
    assert r.choices[0].finish_reason == "tool_calls"
    msg = r.choices[0].message
    return msg, [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]


def script(first: str, named: tuple[str, str], required: tuple[str, str], tool_turn: str,
           reply: str = "Sunny all three days."):
    """A ``recording_server`` answer: to a prompt that ends with a forced call's pre-fill
    (``named[0]``, ``required[0]``) the rest of that call (``named[1]``, ``required[1]``); once a
    tool's result is in the prompt (``tool_turn`` in it) ``reply``; else ``first``."""
    def answer(prompt: str) -> str:
        for end, rest in (named, required):
            if prompt.endswith(end):
                return rest
        return reply if tool_turn in prompt else first
    return answer


def second_turn(srv, messages: list[dict], tools: list[dict]) -> str:
    """The answer's text after the first answer's calls are each answered "ok"."""
    client = srv.openai()
    first = client.chat.completions.create(model=srv.model, messages=messages, tools=tools).choices[0].message
    r = client.chat.completions.create(model=srv.model, messages=answered(messages, first, "ok"), tools=tools)
    return r.choices[0].message.content


def streamed(srv, messages: list[dict], tools: list[dict]) -> tuple[list[str], str]:
    """A streamed OpenAI chat answer: (the first call's argument fragments, the content shown)."""
    chunks = list(srv.openai().chat.completions.create(model=srv.model, messages=messages, tools=tools,
                                                       stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    return ([tc.function.arguments for tc in deltas if tc.index == 0 and tc.function.arguments],
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))


def clients_get_the_calls(srv, messages: list[dict], tools: list[dict], a_tools: list[dict], want: list,
                          content: str, reasoning: str = "The user wants the forecast.") -> None:
    """The scripted answer through both official clients: the OpenAI chat answer's reasoning,
    content and calls (``want``: (name, arguments) each); its stream's first call's arguments in
    more than one piece and the same content; an Anthropic tool_use block per call."""
    msg, got = chat_calls(srv, messages, tools)
    assert (msg.reasoning_content, msg.content, got) == (reasoning, content, want)
    first, shown = streamed(srv, messages, tools)
    assert len(first) > 1 and json.loads("".join(first)) == want[0][1] and shown == content
    assert tool_uses(srv, messages, a_tools) == want


@contextlib.contextmanager
def format_server(folder, named: str, with_tools, tools_marker: str | None = None, without_tools: str = ""):
    """A tool-format module's scripted server: ``recording_server`` on ``folder``'s tokenizer
    (4,096 tokens of context) answering ``with_tools(prompt)``, or, where ``tools_marker`` is
    given and the prompt lacks it, ``without_tools``; ``named`` (the forced call's prefill) kept
    on the server for ``check_forced_calls``."""
    from freetoken_engine.models.tokenizer import Tokenizer

    def answers(prompt: str) -> str:
        return with_tools(prompt) if tools_marker is None or tools_marker in prompt else without_tools
    with recording_server(Tokenizer(folder), answers, max_context=4096) as srv:
        srv.named = named
        yield srv
