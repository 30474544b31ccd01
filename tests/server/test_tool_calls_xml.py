"""Tool calls in Qwen3.5/3.6's XML format (``<function=NAME>`` with ``<parameter=KEY>`` blocks)
through both official clients: a model whose chat template writes that format gets its calls
parsed into typed JSON arguments, its history rendered back in it, and tool_choice pre-filled in
it. The template here is this test's own, in the format Qwen3.5 publishes (thinking opened in
the prompt); the answers come from a ``ScriptedService`` (tests/server/scripted.py)."""
from __future__ import annotations

import json
import shutil

import pytest

from freetoken_engine.models.tokenizer import Tokenizer
from scripted import recording_server

TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool as <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n"
    "</function>\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for tc in m.tool_calls or [] %}{%- set f = tc.function if tc.function is defined else tc %}"
    "{{- '\\n<tool_call>\\n<function=' + f.name + '>\\n' }}"
    "{%- if f.arguments is mapping %}{%- for k, v in f.arguments | items %}"
    "{{- '<parameter=' + k + '>\\n' + (v | tojson if v is mapping or (v is sequence and v is not string) "
    "else v | string) + '\\n</parameter>\\n' }}{%- endfor %}{%- endif %}"
    "{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + (m.content if m.content is string else '') + "
    "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
ANSWER = "The user wants the forecast.\n</think>\n\nChecking.\n" + CALL
ARGS = {"city": "Paris", "days": 3}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
A_TOOLS = [{"name": "get_weather", "description": "forecast", "input_schema": TOOLS[0]["function"]["parameters"]}]
MSGS = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
NAMED_REST = "<parameter=city>\nRome\n</parameter>\n<parameter=days>\n1\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def live(tiny_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("xml-template")
    shutil.copy(tiny_dir / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=TEMPLATE)))

    def answer(prompt: str) -> str:
        if prompt.endswith("<function=get_weather>\n"):
            return NAMED_REST
        return "It will be sunny.\n</think>\n\nSunny all three days." if "<tool_response>" in prompt else ANSWER
    with recording_server(Tokenizer(folder), answer) as srv:
        yield srv


def test_openai_chat_gets_the_xml_call_as_typed_json_arguments(live):
    r = live.openai().chat.completions.create(model=live.model, messages=MSGS, tools=TOOLS)
    msg = r.choices[0].message
    assert msg.reasoning_content == "The user wants the forecast.\n"
    assert msg.content.strip() == "Checking."
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    assert json.loads(msg.tool_calls[0].function.arguments) == ARGS      # days: 3, an integer
    assert r.choices[0].finish_reason == "tool_calls"


def test_openai_stream_names_the_tool_then_its_arguments_a_parameter_at_a_time(live):
    chunks = list(live.openai().chat.completions.create(model=live.model, messages=MSGS, tools=TOOLS,
                                                        stream=True))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    fragments = [tc.function.arguments for tc in calls if tc.function.arguments]
    assert len(fragments) == 3                                          # city, days, the closing brace
    assert json.loads("".join(fragments)) == ARGS
    assert not any("<" in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_calls_history_goes_back_to_the_model_in_its_own_format(live):
    client = live.openai()
    first = client.chat.completions.create(model=live.model, messages=MSGS, tools=TOOLS).choices[0].message
    call = first.tool_calls[0]
    history = MSGS + [{"role": "assistant", "content": first.content, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = client.chat.completions.create(model=live.model, messages=history, tools=TOOLS)
    assert r.choices[0].message.content == "Sunny all three days." and not r.choices[0].message.tool_calls
    assert ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>") in live.prompts[-1]


def test_a_named_tool_choice_is_prefilled_in_the_xml_format(live):
    r = live.openai().chat.completions.create(
        model=live.model, messages=MSGS, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert live.prompts[-1].endswith("<think>\n</think>\n\n<tool_call>\n<function=get_weather>\n")
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome", "days": 1}


def test_anthropic_tool_use_block_from_an_xml_call(live):
    m = live.anthropic().messages.create(model=live.model, max_tokens=200, messages=MSGS, tools=A_TOOLS)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert [b.name for b in uses] == ["get_weather"] and uses[0].input == ARGS
    assert m.stop_reason == "tool_use"
