"""``freetoken serve`` as a user runs it: the real CLI in a subprocess, the embedded default
model (SmolLM2-135M-Instruct as an MoE), the official clients, a clean shutdown on Ctrl-C."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest
from procs import serving

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from conftest_default import default_moe_dir  # noqa: E402,F401  (session fixture: converts once)

KEY = "k-default"
NAME = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference(default_moe_dir) -> str:
    """The engine's own offline answer (greedy, 24 tokens): what the server must serve."""
    from freetoken_engine import LLM, SamplingParams
    llm = LLM(default_moe_dir)
    out = llm.generate(llm.tokenizer.encode_chat(QUESTION),
                       SamplingParams(max_new_tokens=24, temperature=0))
    return llm.tokenizer.decode(out.token_ids)


@pytest.fixture(scope="module")
def served(default_moe_dir):
    with serving(["--api-key", KEY, "--served-model-name", NAME]) as running:
        yield running


def test_openai_client_gets_the_engines_answer(served, reference):
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(model=NAME, temperature=0, max_tokens=24,
                                       messages=QUESTION)
    assert r.choices[0].message.content == reference and reference.strip()
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=NAME, temperature=0, max_tokens=24, stream=True, messages=QUESTION) if c.choices)
    assert streamed == reference


def test_anthropic_client_gets_the_engines_answer(served, reference):
    url, _ = served
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)
    m = client.messages.create(model=NAME, max_tokens=24, extra_body={"temperature": 0},
                               messages=QUESTION)
    assert m.content[0].text == reference and m.usage.output_tokens >= 1


def test_a_json_schema_answer_from_the_real_model(served):
    """The real default model (not random weights) under a schema: the answer parses, satisfies
    it, and is right."""
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    schema = {"type": "object", "additionalProperties": False, "required": ["capital", "country"],
              "properties": {"capital": {"type": "string", "maxLength": 30},
                             "country": {"type": "string", "maxLength": 30}}}
    r = client.chat.completions.create(
        model=NAME, temperature=0, max_tokens=40, messages=[
            {"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, schema)
    assert answer["capital"] == "Paris" and r.choices[0].finish_reason == "stop"


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                          "days": {"type": "integer"}}}
COUNT = {"type": "object", "additionalProperties": False, "required": ["n"],
         "properties": {"n": {"type": "integer"}}}


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_a_forced_tool_call_from_the_default_model_follows_its_schema(served, choice):
    """SmolLM2's tokenizer has no <tool_call> token, so the call the pre-fill opens is text;
    it is still held to one of the tools and its schema (it was free text, with a made-up
    name, before), and the answer ends with it (the model rambled on to max_tokens before)."""
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "count", "parameters": COUNT}}]
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    r = client.chat.completions.create(
        model=NAME, temperature=0, max_tokens=60, tools=tools, tool_choice=tool_choice,
        messages=[{"role": "user", "content": "What is the weather in Paris this week?"}])
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"   # the answer ends with the call
    assert not r.choices[0].message.content
    name = calls[0].function.name
    assert name in ("get_weather", "count") and (choice == "required" or name == choice)
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER if name == "get_weather" else COUNT)


def test_ctrl_c_stops_the_server_cleanly(served):
    url, proc = served
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0


def test_sigterm_stops_the_server_cleanly(default_moe_dir):
    """What the agent and Kubernetes send: the engine shuts down in order and exits 0 (uvicorn
    raised the signal again after its own shutdown: exit 143, the engine never shut down)."""
    with serving(["--api-key", KEY]) as (_, proc):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read()
    assert "Finished server process" in out and "terminate called" not in out
