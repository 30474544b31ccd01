"""The OpenAI Responses API (``/v1/responses``) through the official ``openai`` client: what
Codex and other recent agents speak.

Reasoning, text and tool calls come from a ``ScriptedService`` whose answer is known (the tiny
random model never writes tags); greedy text, token limits and usage from the real engine on
the tiny checkpoint, compared with ``/v1/chat/completions`` on the same prompt.
"""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from live import API_KEY, live_server
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
    ({"tools": [{"type": "function", "name": "bad name!"}]}, ["tools.0", "letters, digits"]),
    ({"tools": [{"type": "custom", "name": "patch", "format": {"type": "grammar"}}]}, ["tools.0.format"]),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}]}, ["tools.0.tools.0"]),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, ["tool_choice", "function or custom"]),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     ["input.0.content", "only text parts"]),
    ({"input": []}, ["input", "must not be empty", "instructions"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, ["tool_choice", "nope"]),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, ["input.0", "send the item itself"]),
    ({"background": True}, ["background", "in the request"]),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     ["text.format.schema", "nonsense"]),
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


# -- what Codex sends ---------------------------------------------------------------------------
GRAMMAR = 'start: "*** Begin Patch" LF body "*** End Patch"'
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch"
CODEX_TOOLS = [
    {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {
        "command": {"type": "array", "items": {"type": "string"}}}}},
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}},
    {"type": "namespace", "name": "mcp__docs", "description": "docs server", "tools": [
        {"type": "function", "name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]},
    {"type": "web_search"}, {"type": "image_generation"}]
CODEX_INPUT = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: workspace-write."}]},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add hello.txt"}]}]


def _call(name: str, args: dict) -> str:
    return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": ' + json.dumps(args) + "}\n</tool_call>"


@pytest.fixture(scope="module")
def codex(tiny_dir, tmp_path_factory):
    """A model whose template refuses a system message after the first, as Qwen3.5's does."""
    folder = tmp_path_factory.mktemp("codex-template")
    (folder / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    template = ("{%- if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
                "{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
                "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}"
                "<|im_start|>{{ m.role }}\n{{ m.content }}"
                "{%- for c in m.tool_calls or [] %}" + '<tool_call>{"name": "{{ c.function.name }}", '
                '"arguments": {{ c.function.arguments | tojson }}}</tool_call>' + "{%- endfor %}<|im_end|>\n"
                "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=template)))
    prompts = []

    def script(prompt: str) -> str:
        prompts.append(prompt)
        if "search the docs" in prompt:
            return _call("mcp__docs.search", {"q": "patch format"})
        return "Done." if "<|im_start|>tool" in prompt else "Writing it. " + _call("apply_patch", {"input": PATCH})
    with live_server(ScriptedService(Tokenizer(folder), script=script, max_context=4096)) as srv:
        srv.prompts = prompts
        yield srv


def test_codex_tools_custom_namespaced_and_hosted(codex):
    """The custom tool's call comes back as custom_tool_call with its raw text; the model saw
    its grammar and the namespaced tool; hosted tools are left out of the prompt; instructions
    and the developer message are one first system message."""
    r = codex.openai().responses.create(model=codex.model, instructions="You are Codex.", input=CODEX_INPUT,
                                        tools=CODEX_TOOLS, store=False, parallel_tool_calls=False,
                                        include=["reasoning.encrypted_content"], reasoning={"effort": "medium"})
    assert [item.type for item in r.output] == ["message", "custom_tool_call"]
    call = r.output[1]
    assert call.name == "apply_patch" and call.input == PATCH and call.call_id.startswith("call_")
    prompt = codex.prompts[-1]
    assert "<|im_start|>system\nYou are Codex.\n\nSandbox: workspace-write.<|im_end|>" in prompt
    assert GRAMMAR.replace('"', '\\"') in prompt and '"name": "mcp__docs.search"' in prompt
    assert "web_search" not in prompt and "image_generation" not in prompt


def test_a_custom_call_streams_its_input_and_goes_back_as_history(codex):
    client = codex.openai()
    with client.responses.stream(model=codex.model, input=CODEX_INPUT, tools=CODEX_TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    assert deltas == [PATCH] and [e.input for e in events if e.type == "response.custom_tool_call_input.done"] == [PATCH]
    call = final.output[1]
    assert call.type == "custom_tool_call" and call.input == PATCH
    history = CODEX_INPUT + [item.model_dump(exclude_none=True) for item in final.output] + [
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Success. Updated hello.txt"},
        {"type": "message", "role": "developer", "content": "Approvals: never."}]   # after the start
    r = client.responses.create(model=codex.model, input=history, tools=CODEX_TOOLS)
    assert r.output_text == "Done."
    prompt = codex.prompts[-1]
    assert '<tool_call>{"name": "apply_patch", "arguments": {"input": ' + json.dumps(PATCH) + "}}</tool_call>" in prompt
    assert "<|im_start|>tool\nSuccess. Updated hello.txt<|im_end|>" in prompt
    assert "<|im_start|>user\nApprovals: never.<|im_end|>" in prompt    # the template refuses a late system


def test_a_namespaced_call_names_its_namespace_both_ways(codex):
    client = codex.openai()
    r = client.responses.create(model=codex.model, input="Please search the docs.", tools=CODEX_TOOLS)
    call = r.output[0]
    assert call.type == "function_call" and (call.namespace, call.name) == ("mcp__docs", "search")
    assert json.loads(call.arguments) == {"q": "patch format"}
    history = [{"role": "user", "content": "Please search the docs."}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "found"}]
    client.responses.create(model=codex.model, input=history, tools=CODEX_TOOLS)
    assert '<tool_call>{"name": "mcp__docs.search", "arguments": {"q": "patch format"}}</tool_call>' in codex.prompts[-1]


def test_instructions_alone_are_a_valid_probe(codex):
    r = codex.openai().responses.create(model=codex.model, instructions="Say hi.", input=[], max_output_tokens=1)
    assert r.status == "incomplete" and r.usage.output_tokens == 1


def test_a_custom_call_in_qwen35s_xml_format_keeps_the_patch_text(tiny_dir, tmp_path):
    """Qwen3.5/3.6 write calls as <function=NAME><parameter=KEY>: the patch is the one
    parameter's raw text, returned as the custom call's input character for character."""
    from test_tool_calls_xml import TEMPLATE
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=TEMPLATE)))
    answer = ("The user wants a file.\n</think>\n\n<tool_call>\n<function=apply_patch>\n<parameter=input>\n"
              + PATCH + "\n</parameter>\n</function>\n</tool_call>")
    with live_server(ScriptedService(Tokenizer(tmp_path), script=lambda prompt: answer, max_context=4096)) as srv:
        r = srv.openai().responses.create(model=srv.model, input="Add hello.txt", tools=CODEX_TOOLS)
    assert [item.type for item in r.output] == ["reasoning", "custom_tool_call"]
    assert r.output[1].name == "apply_patch" and r.output[1].input == PATCH


def test_a_client_that_leaves_a_response_stream_frees_its_request(client, live):
    """The engine stops generating when the agent goes away mid-stream (Codex's Ctrl-C)."""
    svc = live.service
    body = {"model": live.model, "input": "Count to a million.", "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/responses", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()
        [next(lines) for _ in range(12)]                 # created, in_progress, the message, deltas
        assert svc.stats()["running"] == 1
    deadline = time.monotonic() + 3
    while svc.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert svc.stats()["running"] == 0 and svc.stats()["queued"] == 0
