"""The OpenAI Responses API (``/v1/responses``) through the official ``openai`` client: what
Codex and other recent agents speak.

Reasoning, text and tool calls come from a ``ScriptedService`` whose answer is known (the tiny
random model never writes tags); greedy text, token limits and usage from the real engine on
the tiny checkpoint, compared with ``/v1/chat/completions`` on the same prompt.
"""
from __future__ import annotations

import json

import openai
import pytest

from live import live_server
from freetoken_engine.models.tokenizer import Tokenizer
from scripted import ScriptedService

ARGS = {"city": "Paris", "unit": "celsius"}
ANSWER = ("<think>The user wants the weather in Paris.</think>\n\nLet me check. "
          '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(ARGS) + "}\n</tool_call>")
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
QUESTION = "Weather in Paris?"


@pytest.fixture(scope="module")
def scripted(tiny_dir):
    prompts = []

    def script(prompt: str) -> str:
        prompts.append(prompt)
        return "It is sunny in Paris." if "sunny, 24 C" in prompt else ANSWER
    with live_server(ScriptedService(Tokenizer(tiny_dir), script=script)) as srv:
        srv.prompts = prompts
        yield srv


def test_reasoning_text_and_call_come_back_as_output_items_in_order(scripted):
    r = scripted.openai().responses.create(model=scripted.model, input=QUESTION, tools=TOOLS)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "The user wants the weather in Paris."
    assert r.output_text == "Let me check. "
    call = r.output[2]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and json.loads(call.arguments) == ARGS
    assert r.status == "completed" and r.store is False
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_the_stream_helper_rebuilds_the_same_response(scripted):
    client = scripted.openai()
    with client.responses.stream(model=scripted.model, input=QUESTION, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        "The user wants the weather in Paris."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Let me check. "
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) > 2 and json.loads("".join(fragments)) == ARGS   # arguments stream as written
    assert not any("<" in e.delta for e in events if e.type == "response.output_text.delta")
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    done = [e.item.id for e in events if e.type == "response.output_item.done"]
    assert added == done == [item.id for item in final.output]
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Let me check. " and json.loads(final.output[2].arguments) == ARGS


def test_a_whole_conversation_goes_back_through_the_chat_template(scripted):
    """No state on the server: the agent sends the last output back with the tool's result,
    as Codex does with store=false; the template renders the call and its output."""
    client = scripted.openai()
    first = client.responses.create(model=scripted.model, input=QUESTION, tools=TOOLS)
    call = first.output[2]
    history = [{"role": "user", "content": QUESTION}] + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}]
    second = client.responses.create(model=scripted.model, input=history, tools=TOOLS,
                                     instructions="You are a weather bot.", store=False)
    assert second.output_text == "It is sunny in Paris." and [i.type for i in second.output] == ["message"]
    prompt = scripted.prompts[-1]          # the tiny checkpoint's template: Hermes-style calls
    call_text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    order = ["<|im_start|>systemYou are a weather bot.", QUESTION, "<|im_start|>assistantLet me check. " + call_text,
             "<|im_start|>toolsunny, 24 C<|im_end|>"]
    assert all(part in prompt for part in order), prompt
    assert sorted(order, key=prompt.index) == order


@pytest.fixture(scope="module")
def client(live):
    return live.openai()


def test_greedy_text_equals_chat_completions_and_the_limit_marks_it_incomplete(client, live):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=live.model, messages=messages, temperature=0, max_tokens=6)
    r = client.responses.create(model=live.model, input=messages, temperature=0, max_output_tokens=6)
    assert r.output_text == chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "length"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 6 and r.usage.input_tokens == chat.usage.prompt_tokens
    events = list(client.responses.create(model=live.model, input=messages, temperature=0, max_output_tokens=6,
                                          stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text


@pytest.mark.parametrize("kw, names", [
    ({"previous_response_id": "resp_1"}, ["previous_response_id", "whole conversation"]),
    ({"tools": [{"type": "web_search"}]}, ["tools.0", "only function tools"]),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     ["input.0.content", "only text parts"]),
    ({"input": []}, ["input", "must not be empty"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, ["tool_choice", "nope"]),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, ["input.0", "send the item itself"]),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, ["text.format"]),
])
def test_what_this_server_cannot_do_is_a_400_that_says_what(client, live, kw, names):
    kw.setdefault("input", "hi")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=live.model, **kw)
    message = err.value.body["message"]
    assert all(name in message for name in names), message


def test_an_unknown_model_is_a_404_naming_the_served_one(client, live):
    with pytest.raises(openai.NotFoundError, match=live.model):
        client.responses.create(model="gpt-5", input="hi")
