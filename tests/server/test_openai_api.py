"""The official ``openai`` client against a live server on the tiny random checkpoint.

Greedy decoding makes every answer a fixed function of the prompt, so streaming and
non-streaming, stop strings and tool calls can be compared exactly.
"""
from __future__ import annotations

import json

import pytest

MSGS = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client(live):
    return live.openai()


def chat(client, live, **kw):
    kw.setdefault("messages", MSGS)
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=live.model, temperature=0, **kw)


def test_models_lists_the_served_model(client, live):
    assert [m.id for m in client.models.list().data] == [live.model]
    assert client.models.retrieve(live.model).id == live.model


def test_chat_greedy_answer_is_repeatable_and_counts_tokens(client, live):
    a, b = chat(client, live), chat(client, live)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.role == "assistant"
    assert a.choices[0].finish_reason in ("stop", "length")
    u = a.usage
    assert u.prompt_tokens > 5 and 1 <= u.completion_tokens <= 24
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_stream_equals_the_plain_answer_and_ends_with_usage(client, live):
    plain = chat(client, live)
    chunks = list(chat(client, live, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_stop_string_ends_the_answer_before_it(client, live):
    full = chat(client, live, max_tokens=32).choices[0].message.content
    assert len(full) > 8, "the tiny model's greedy answer is too short to cut"
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = chat(client, live, max_tokens=32, stop=[stop])
    assert cut.choices[0].message.content == full[: full.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in chat(client, live, max_tokens=32, stop=stop, stream=True))
    assert streamed == full[: full.find(stop)]


def test_completions_plain_and_streaming_agree(client, live):
    kw = dict(model=live.model, prompt="The quick brown fox", max_tokens=12, temperature=0)
    plain = client.completions.create(**kw)
    assert plain.object == "text_completion" and plain.usage.completion_tokens >= 1
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == plain.choices[0].text


def test_max_tokens_past_the_context_is_clamped_not_refused(client, live):
    room = 6
    prompt = [10] * (live.service.max_context - room)
    r = client.completions.create(model=live.model, prompt=prompt, max_tokens=10**6,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == room


def test_named_tool_choice_always_returns_that_tool(client, live):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    plain = chat(client, live, tools=TOOLS, tool_choice=choice, max_tokens=16)
    calls = plain.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert calls[0].id.startswith("call_") and calls[0].type == "function"
    # streamed: one tool call announced once (index, id, name), then argument fragments
    deltas = [tc for c in chat(client, live, tools=TOOLS, tool_choice=choice, max_tokens=16,
                               stream=True) if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].index == 0 and deltas[0].id and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == calls[0].function.arguments


def test_tool_choice_none_hides_the_tools(client, live):
    with_none = chat(client, live, tools=TOOLS, tool_choice="none")
    without = chat(client, live)
    assert with_none.choices[0].message.content == without.choices[0].message.content
    assert not with_none.choices[0].message.tool_calls


def test_tool_results_round_trip_into_the_next_turn(client, live):
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = chat(client, live, messages=history, tools=TOOLS)
    assert r.usage.prompt_tokens > chat(client, live).usage.prompt_tokens


def test_history_with_arguments_that_are_not_json_is_still_accepted(client, live):
    """A model may write malformed arguments; the agent sends them back next turn."""
    history = MSGS + [
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Par'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "error: bad arguments"}]
    r = chat(client, live, messages=history, tools=TOOLS, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
