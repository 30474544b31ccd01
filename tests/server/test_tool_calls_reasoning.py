"""Tool calls and reasoning through both official clients, from a model whose output is known.

A random tiny checkpoint never writes ``<tool_call>`` or ``<think>`` by itself, so these tests
serve a ``ScriptedService`` (tests/server/scripted.py): the same EngineService interface, the
real tokenizer, and an answer fixed by the test. Everything from token ids to the client's
parsed objects is the production path.
"""
from __future__ import annotations

import json

import pytest

from live import live_server
from freetoken_engine.models.tokenizer import Tokenizer
from scripted import ScriptedService

ARGS = {"city": "Paris", "unit": "celsius"}
ANSWER = ("<think>The user wants the weather in Paris.</think>\n\nLet me check. "
          '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(ARGS) + "}\n</tool_call>")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
A_TOOLS = [{"name": "get_weather", "description": "weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def live(tiny_dir):
    # the tiny tokenizer keeps <think>/<tool_call> as non-special added tokens, as Qwen3 does
    def script(prompt: str) -> str:
        return " 42." if prompt.endswith("The answer is") else ANSWER
    with live_server(ScriptedService(Tokenizer(tiny_dir), script=script)) as srv:
        yield srv


def test_openai_chat_splits_reasoning_content_and_tool_call(live):
    r = live.openai().chat.completions.create(model=live.model, messages=MSGS, tools=TOOLS)
    msg = r.choices[0].message
    assert msg.reasoning_content == "The user wants the weather in Paris."
    assert msg.content == "Let me check. "
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    assert json.loads(msg.tool_calls[0].function.arguments) == ARGS
    assert r.choices[0].finish_reason == "tool_calls"


def test_openai_stream_announces_the_tool_then_streams_its_arguments(live):
    chunks = list(live.openai().chat.completions.create(model=live.model, messages=MSGS,
                                                        tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == "The user wants the weather in Paris."
    assert "".join(d.content or "" for d in deltas) == "Let me check. "
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert len(calls) > 2, "arguments should arrive in several fragments"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == ARGS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any("<" in (d.content or "") for d in deltas), "no tag text reaches the client"


def test_without_tools_the_tool_call_text_is_plain_content(live):
    r = live.openai().chat.completions.create(model=live.model, messages=MSGS)
    assert "<tool_call>" in r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_anthropic_message_has_thinking_text_and_tool_use_blocks(live):
    m = live.anthropic().messages.create(model=live.model, max_tokens=200, messages=MSGS,
                                         tools=A_TOOLS,
                                         thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "The user wants the weather in Paris."
    assert m.content[1].text == "Let me check. "
    assert m.content[2].name == "get_weather" and m.content[2].input == ARGS
    assert m.content[2].id.startswith("toolu_") and m.stop_reason == "tool_use"


def test_anthropic_stream_events_build_the_same_message(live):
    client = live.anthropic()
    kinds = []
    with client.messages.stream(model=live.model, max_tokens=200, messages=MSGS,
                                tools=A_TOOLS) as stream:
        for event in stream:
            kinds.append((event.type, getattr(getattr(event, "delta", None), "type", None)))
        final = stream.get_final_message()
    assert kinds[0] == ("message_start", None) and kinds[-1] == ("message_stop", None)
    assert ("content_block_delta", "thinking_delta") in kinds
    assert ("content_block_delta", "text_delta") in kinds
    assert ("content_block_delta", "input_json_delta") in kinds
    assert ("message_delta", None) in kinds
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == ARGS and final.stop_reason == "tool_use"


def test_anthropic_tool_result_history_is_accepted(live):
    history = MSGS + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "need weather", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "text", "text": "and tomorrow?"}]}]
    client = live.anthropic()
    m = client.messages.create(model=live.model, max_tokens=200, messages=history, tools=A_TOOLS)
    n = client.messages.count_tokens(model=live.model, messages=history, tools=A_TOOLS)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n.input_tokens


def test_anthropic_assistant_prefill_is_continued_not_repeated(live):
    m = live.anthropic().messages.create(model=live.model, max_tokens=20, messages=MSGS + [
        {"role": "assistant", "content": "The answer is"}])
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == " 42."
