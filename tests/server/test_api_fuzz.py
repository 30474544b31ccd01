"""Fuzz every endpoint with hypothesis: nothing a client sends yields a 500 or stops the server.

Bodies are valid requests with fields replaced by arbitrary JSON, extra keys, or not JSON at
all. Every answer must be < 500, and every error must carry the protocol's error shape.
Cases that once broke the server are kept as ``@example``s.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from freetoken_engine.server.app import ServerConfig, create_app
from live import start_service

SMALL_INTS = st.integers(-3, 8) | st.sampled_from([0, 2**31, 2**63, -2**63, 10**40])
TEXT = st.text(max_size=12) | st.text(st.characters(categories=["Cs"]), max_size=2)  # surrogates
SCALARS = st.none() | st.booleans() | SMALL_INTS | st.floats(allow_nan=False, width=32) | TEXT
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)

MSG = {"role": "user", "content": "hi"}
VALID = {
    "/v1/chat/completions": {"model": "M", "messages": [MSG], "max_tokens": 3,
                             "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                 "type": "object", "properties": {}}}}]},
    "/v1/completions": {"model": "M", "prompt": "hi", "max_tokens": 3},
    "/v1/messages": {"model": "M", "messages": [MSG], "max_tokens": 3, "system": "s",
                     "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
    "/v1/messages/count_tokens": {"model": "M", "messages": [MSG]},
    "/v1/responses": {"model": "M", "input": [MSG, {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": "{}"},
                                              {"type": "function_call_output", "call_id": "c", "output": "x"},
                                              {"type": "custom_tool_call", "call_id": "d", "name": "p", "input": "x"}],
                      "instructions": "s", "max_output_tokens": 3,
                      "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}},
                                {"type": "custom", "name": "p", "format": {"type": "text"}},
                                {"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "g"}]},
                                {"type": "web_search"}]},
    "/admin/cache": {"expert_cache_experts": 4},
    "/admin/calibrate": {"fill_fraction": 0.5},
}
KEYS = sorted({k for body in VALID.values() for k in body} | {
    "stream", "stop", "stop_sequences", "tool_choice", "temperature", "top_p", "top_k", "n",
    "seed", "thinking", "stream_options", "logprobs", "content", "role", "reasoning", "text",
    "previous_response_id", "response_format", "structured_outputs", "logit_bias", "top_logprobs",
    "output_config", "output_format"})


@st.composite
def bodies(draw):
    path = draw(st.sampled_from(sorted(VALID)))
    body = dict(VALID[path])
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=3, unique=True)):
        body[key] = draw(JSON)
    if draw(st.booleans()):        # keep generation short: a valid small max_tokens
        body["max_tokens"] = draw(st.integers(1, 3))
    if "messages" in body and draw(st.booleans()):
        body["messages"] = [dict(MSG, **{draw(st.sampled_from(["role", "content", "tool_calls",
                                                               "name"])): draw(JSON)})]
    if body.get("input") == VALID["/v1/responses"]["input"] and draw(st.booleans()):
        k = draw(st.integers(0, len(body["input"]) - 1))
        body["input"] = list(body["input"])
        body["input"][k] = dict(body["input"][k], **{draw(st.sampled_from(
            ["type", "role", "content", "call_id", "name", "arguments", "output", "summary", "input",
             "namespace"])): draw(JSON)})
    if path == "/v1/responses" and body.get("tools") == VALID[path]["tools"] and draw(st.booleans()):
        k = draw(st.integers(0, len(body["tools"]) - 1))
        body["tools"] = list(body["tools"])
        body["tools"][k] = dict(body["tools"][k], **{draw(st.sampled_from(
            ["type", "name", "format", "tools", "parameters"])): draw(JSON)})
    return path, json.dumps(body).encode()


@pytest.fixture(scope="module")
def app(tiny_dir):
    # a short context bounds the work of any body (a fuzzed max_tokens may be null or huge)
    svc = start_service(tiny_dir, max_context=128)
    yield create_app(svc, ServerConfig(served_model_name="M"))
    svc.shutdown()


def check(app, path: str, raw: bytes):
    async def go():
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://e", timeout=30) as c:
            return await c.post(path, content=raw, headers={"content-type": "application/json"})
    r = asyncio.run(go())
    assert r.status_code < 500, (path, raw, r.status_code, r.text)
    if r.status_code >= 400:
        body = r.json()
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and body["error"]["message"]
        else:
            assert body["error"]["message"] and body["error"]["type"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=bodies())
@example(case=("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stop": ""}'))
@example(case=("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], "max_tokens": 1}'))
@example(case=("/v1/completions", b'{"model": "M", "prompt": [99999999], "max_tokens": 1}'))
@example(case=("/v1/completions", b'{"model": "M", "prompt": [[]], "max_tokens": 1}'))
@example(case=("/v1/messages", b'{"model": "M", "messages": [{"role": "user", "content": []}], "max_tokens": 1}'))
@example(case=("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "seed": 18446744073709551615}'))
@example(case=("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}'))
@example(case=("/v1/completions", b'{"model": "M", "prompt": "a\\udfff", "max_tokens": 1}'))
@example(case=("/v1/messages/count_tokens", b'{"model": "M", "system": "\\ud800", "messages": [{"role": "user", "content": "x"}]}'))
@example(case=("/v1/completions", b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 3}'))   # echoed in the 404
@example(case=("/v1/messages", b'{"model": "\\udc00x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'))
@example(case=("/v1/chat/completions", b"[" * 50_000 + b"]" * 50_000))
def test_no_request_body_breaks_the_server(app, case):
    check(app, *case)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(sorted(VALID)), raw=st.binary(max_size=64))
def test_bytes_that_are_not_json_are_rejected_cleanly(app, path, raw):
    check(app, path, raw)
