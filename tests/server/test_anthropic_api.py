"""The official ``anthropic`` client against a live server on the tiny random checkpoint."""
from __future__ import annotations

import pytest

# anthropic >= 2 no longer has a temperature argument; the server still honours the field
GREEDY = {"temperature": 0}
MSGS = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"name": "get_weather", "description": "weather",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def client(live):
    return live.anthropic()


def create(client, live, **kw):
    kw.setdefault("messages", MSGS)
    kw.setdefault("max_tokens", 24)
    return client.messages.create(model=live.model, extra_body=GREEDY, **kw)


def test_message_is_text_with_usage_that_matches_count_tokens(client, live):
    m = create(client, live, system="Be brief.")
    assert m.type == "message" and m.role == "assistant" and m.model == live.model
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    n = client.messages.count_tokens(model=live.model, messages=MSGS, system="Be brief.")
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == n.input_tokens
    assert 1 <= m.usage.output_tokens <= 24


def test_stream_events_rebuild_the_plain_message(client, live):
    plain = create(client, live)
    with client.messages.stream(model=live.model, max_tokens=24, extra_body=GREEDY,
                                messages=MSGS) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert types[-2] == "message_delta" and "content_block_start" in types
    assert final.content[0].text == plain.content[0].text
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_stop_sequence_is_reported(client, live):
    full = create(client, live, max_tokens=32).content[0].text
    assert len(full) > 8
    stop = full[len(full) // 2: len(full) // 2 + 3]
    m = create(client, live, max_tokens=32, stop_sequences=[stop])
    assert m.content[0].text == full[: full.find(stop)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_count_tokens_grows_with_tools(client, live):
    plain = client.messages.count_tokens(model=live.model, messages=MSGS).input_tokens
    tools = client.messages.count_tokens(model=live.model, messages=MSGS, tools=TOOLS).input_tokens
    assert tools > plain > 5


def test_forced_tool_returns_a_tool_use_block(client, live):
    m = create(client, live, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    blocks = [b for b in m.content if b.type == "tool_use"]
    assert len(blocks) == 1 and blocks[0].name == "get_weather"
    assert isinstance(blocks[0].input, dict)
    with client.messages.stream(model=live.model, max_tokens=24, extra_body=GREEDY, messages=MSGS,
                                tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [blocks[0].input]
