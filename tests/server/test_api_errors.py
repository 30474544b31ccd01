"""Every error class a client can provoke: right status, the protocol's error shape, a message
that says what to fix, and the server keeps serving afterwards."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from freetoken_engine.server.app import ServerConfig, create_app
from live import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=30) as c:
        yield c


def chat_body(live, **kw):
    return {"model": live.model, "messages": MSGS, "max_tokens": 4, **kw}


def openai_error(r: httpx.Response, status: int, *, param: str | None = None, says: str = ""):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert says.lower() in err["message"].lower(), err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def anthropic_error(r: httpx.Response, status: int, kind: str, says: str = ""):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    assert says.lower() in body["error"]["message"].lower(), body["error"]["message"]


def test_invalid_json_is_400_in_each_protocols_shape(http):
    r = http.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    openai_error(r, 400, says="not valid JSON")
    r = http.post("/v1/messages", content=b"[1,", headers={"content-type": "application/json"})
    anthropic_error(r, 400, "invalid_request_error", "not valid JSON")


def test_a_body_not_sent_as_json_says_which_header_to_send(http, live):
    """curl -d without -H sends application/x-www-form-urlencoded: the answer names the header
    (it was 'body: Input should be a valid dictionary ...')."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    r = http.post("/v1/chat/completions", content=json.dumps(chat_body(live)), headers=form)
    openai_error(r, 400, says="Content-Type: application/json")
    r = http.post("/v1/messages", content=json.dumps(chat_body(live)), headers=form)
    anthropic_error(r, 400, "invalid_request_error", "Content-Type: application/json")
    r = http.post("/v1/chat/completions", content=json.dumps(chat_body(live)),
                  headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("patch,param,says", [
    ({"messages": "hi"}, "messages", "valid list"),
    ({"messages": []}, "messages", "at least 1"),
    ({"max_tokens": -5}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": 10**40}, "max_tokens", "less than or equal"),
    ({"max_tokens": "lots"}, "max_tokens", "integer"),
    ({"temperature": 7}, "temperature", "less than or equal to 2"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"n": 33}, "n", "less than or equal to 32"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"min_p": -0.1}, "min_p", "greater than or equal to 0"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "input should be"),
])
def test_wrong_values_are_400_naming_the_field(http, live, patch, param, says):
    openai_error(http.post("/v1/chat/completions", json=chat_body(live, **patch)), 400,
                 param=param, says=says)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_float_that_is_not_finite_is_400_saying_so(http, live, value):
    """Python's JSON parser reads NaN and Infinity; they were refused as out of range ("less than
    or equal to 2" for a NaN temperature), now as what they are, in both protocols."""
    body = json.dumps(chat_body(live, top_p=0.5)).replace('"top_p": 0.5', f'"top_p": {value}')
    r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    openai_error(r, 400, param="top_p", says="finite number")
    body = json.dumps({"model": live.model, "max_tokens": 2, "messages": MSGS, "temperature": 0.5})
    r = http.post("/v1/messages", content=body.replace('"temperature": 0.5', f'"temperature": {value}'),
                  headers={"content-type": "application/json"})
    anthropic_error(r, 400, "invalid_request_error", "finite number")


@pytest.mark.parametrize("patch,param", [
    ({"top_logprobs": 2}, "top_logprobs"), ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_unsupported_parameters_are_400_naming_the_parameter(http, live, patch, param):
    err = openai_error(http.post("/v1/chat/completions", json=chat_body(live, **patch)), 400,
                       param=param)
    assert param in err["message"] and err["code"] == "unsupported_parameter"


def test_malformed_tool_schemas_are_400(http, live):
    bad_params = [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]
    openai_error(http.post("/v1/chat/completions", json=chat_body(live, tools=bad_params)), 400,
                 says="type 'object'")
    bad_name = [{"type": "function", "function": {"name": "no spaces allowed"}}]
    openai_error(http.post("/v1/chat/completions", json=chat_body(live, tools=bad_name)), 400,
                 param="tools.0.function.name")
    r = http.post("/v1/messages", json={"model": "x", "max_tokens": 4, "messages": MSGS,
                                        "tools": [{"name": "f", "input_schema": "nope"}]})
    anthropic_error(r, 400, "invalid_request_error", "tools.0.input_schema")


def test_two_tools_of_one_name_are_400_in_each_api(http, live):
    """A call names its tool, so two tools of one name would share one schema (the second one
    silently replaced the first)."""
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = http.post("/v1/chat/completions", json=chat_body(live, tools=[fn, fn]))
    openai_error(r, 400, param="tools", says="'f' is given twice")
    tool = {"name": "f", "input_schema": {"type": "object"}}
    r = http.post("/v1/messages", json={"model": live.model, "max_tokens": 4, "messages": MSGS,
                                        "tools": [tool, tool]}, headers={"x-api-key": API_KEY})
    anthropic_error(r, 400, "invalid_request_error", "'f' is given twice")
    r = http.post("/v1/responses", json={"model": live.model, "input": "hi", "max_output_tokens": 4,
                                         "tools": [{"type": "function", "name": "f"}] * 2})
    openai_error(r, 400, says="'f' is given twice")


@pytest.mark.parametrize("messages,empty", [
    ([{"role": "user", "content": []}], 0),
    ([{"role": "user", "content": ""}], 0),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}, {"role": "user", "content": "x"}], 1),
])
def test_an_empty_anthropic_message_is_400_naming_it(http, live, messages, empty):
    """Anthropic's API refuses an empty turn; it was answered as if the user had said nothing."""
    r = http.post("/v1/messages", json={"model": live.model, "max_tokens": 4, "messages": messages},
                  headers={"x-api-key": API_KEY})
    anthropic_error(r, 400, "invalid_request_error", f"messages.{empty}: the content is empty")


def test_an_empty_final_assistant_message_is_a_prefill_not_an_error(http, live):
    r = http.post("/v1/messages", json={"model": live.model, "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}, headers={"x-api-key": API_KEY})
    assert r.status_code == 200, r.text


def test_image_content_is_400_naming_the_part(http, live):
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    openai_error(http.post("/v1/chat/completions", json=chat_body(live, messages=msgs)), 400,
                 says="only text parts")


def test_token_ids_outside_the_vocabulary_are_400(http, live):
    r = http.post("/v1/completions", json={"model": live.model, "prompt": [5, 10**9], "max_tokens": 2})
    openai_error(r, 400, says="outside the vocabulary")


def test_api_key_is_required_and_checked_with_either_header(live):
    with pytest.raises(openai.AuthenticationError):
        live.openai(api_key="wrong").models.list()
    with pytest.raises(anthropic.AuthenticationError) as exc:
        live.anthropic(api_key="wrong").messages.create(model=live.model, max_tokens=2, messages=MSGS)
    assert exc.value.body["type"] == "error"
    r = httpx.get(f"{live.url}/v1/models")
    openai_error(r, 401, says="missing API key")
    assert httpx.get(f"{live.url}/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
    assert httpx.get(f"{live.url}/health").status_code == 200   # health needs no key


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
FN = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("history,where,says", [
    ([{"role": "tool", "tool_call_id": "call_9", "content": "42"}], "messages.2", "answers no open tool_call"),
    ([{"role": "user", "content": "and?"}], "messages.1", "'call_1' got no tool message before messages.2"),
    ([{"role": "tool", "tool_call_id": "call_1", "content": "1"}, {"role": "tool", "tool_call_id": "call_1",
      "content": "2"}], "messages.3", "'call_1' answers no open"),
])
def test_openai_tool_results_must_answer_the_calls_before_them(live, history, where, says):
    """As OpenAI's API: a result under an id no call has (or answered twice), and a call left
    unanswered, are 400s naming the message; the model never sees a result under the wrong call."""
    msgs = [MSGS[0], {"role": "assistant", "content": None, "tool_calls": [CALL]}, *history]
    with pytest.raises(openai.BadRequestError) as e:
        live.openai().chat.completions.create(model=live.model, messages=msgs, tools=FN, max_tokens=4)
    assert e.value.body["param"] == where and says in e.value.message, e.value.message
    ok = [MSGS[0], {"role": "assistant", "content": None, "tool_calls": [CALL]},
          {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    assert live.openai().chat.completions.create(model=live.model, messages=ok, tools=FN, max_tokens=4).choices
    no_id = [*ok[:2], {"role": "tool", "content": "42"}]   # some clients send none: the next open call
    assert live.openai().chat.completions.create(model=live.model, messages=no_id, tools=FN, max_tokens=4).choices


def test_anthropic_tool_results_must_answer_the_tool_uses_before_them(live):
    use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    tools = [{"name": "f", "input_schema": {"type": "object"}}]

    def send(reply):
        msgs = [MSGS[0], {"role": "assistant", "content": [use]}, {"role": "user", "content": reply}]
        return live.anthropic().messages.create(model=live.model, max_tokens=4, messages=msgs, tools=tools)

    with pytest.raises(anthropic.BadRequestError) as e:
        send([{"type": "tool_result", "tool_use_id": "toolu_9", "content": "42"}])
    assert "messages.2.content.0: tool_use_id 'toolu_9' answers no open tool_use" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        send("and?")
    assert "messages.1: its tool_use 'toolu_1' got no tool_result" in e.value.message
    assert send([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"},
                 {"type": "text", "text": "go on"}]).content is not None


def test_responses_outputs_must_answer_the_function_calls_before_them(live):
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    with pytest.raises(openai.BadRequestError) as e:
        live.openai().responses.create(model=live.model, max_output_tokens=4, tools=tools, input=[
            {"role": "user", "content": "hi"}, call, {"type": "function_call_output", "call_id": "c2", "output": "1"}])
    assert "input.2: call_id 'c2' answers no open function_call" in e.value.message
    r = live.openai().responses.create(model=live.model, max_output_tokens=4, tools=tools, input=[
        {"role": "user", "content": "hi"}, call, {"type": "function_call_output", "call_id": "c1", "output": "1"}])
    assert r.status == "completed" or r.output is not None


def test_unknown_model_is_404_in_both_clients(live):
    with pytest.raises(openai.NotFoundError) as e1:
        live.openai().chat.completions.create(model="gpt-99", messages=MSGS)
    assert "gpt-99" in e1.value.message and e1.value.body["code"] == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as e2:
        live.anthropic().messages.create(model="claude-x", max_tokens=4, messages=MSGS)
    assert e2.value.body["error"]["type"] == "not_found_error"


def test_unknown_route_is_404_json(http):
    openai_error(http.get("/v1/nothing"), 404, says="no route")


def test_prompt_longer_than_the_context_is_413(live):
    long = [{"role": "user", "content": "Paris fox dog " * 600}]
    with pytest.raises(openai.APIStatusError) as e1:
        live.openai().chat.completions.create(model=live.model, messages=long, max_tokens=4)
    assert e1.value.status_code == 413 and "context" in e1.value.message
    with pytest.raises(anthropic.APIStatusError) as e2:
        live.anthropic().messages.create(model=live.model, messages=long, max_tokens=4)
    assert e2.value.status_code == 413
    assert e2.value.body["error"]["type"] == "request_too_large"


def test_the_server_still_answers_after_all_of_that(live):
    r = live.openai().chat.completions.create(model=live.model, messages=MSGS, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


# -- admin and body limits, on an in-process app (the client address can be set) ----------
def asgi(app, client=("127.0.0.1", 4000)) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=client),
                             base_url="http://engine")


async def test_admin_without_token_serves_loopback_only(tiny_service):
    app = create_app(tiny_service, ServerConfig())
    async with asgi(app) as local, asgi(app, ("10.1.2.3", 4000)) as remote:
        assert (await local.get("/admin/cache")).status_code == 200
        r = await remote.get("/admin/cache")
        assert r.status_code == 403 and "loopback" in r.json()["error"]["message"]
        r = await local.post("/admin/cache", json={"expert_cache_gb": 1})
        assert r.status_code == 422 and "expert_cache_experts" in r.json()["error"]["message"]


async def test_admin_bodies_refuse_numbers_that_are_not_finite(tiny_service):
    """An infinite bandwidth was accepted and then failed as 'fill_fraction ... got nan'."""
    app = create_app(tiny_service, ServerConfig())
    async with asgi(app) as local:
        r = await local.post("/admin/calibrate", content=b'{"pcie_gbps": Infinity, "cpu_expert_gbps": 20}',
                             headers={"content-type": "application/json"})
        assert r.status_code == 422 and "pcie_gbps: Input should be a finite number" in r.json()["error"]["message"]


@pytest.mark.parametrize("host,key,warned", [
    ("0.0.0.0", None, True), ("::", None, True), ("192.168.1.5", None, True), ("0.0.0.0", "k", False),
    ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False)])
def test_serving_beyond_loopback_without_an_api_key_is_a_warning(tiny_dir, monkeypatch, caplog, host, key, warned):
    """`freetoken serve --host 0.0.0.0` without a key serves anyone who can reach it: it still
    starts (a trusted network may want that), with one warning line saying so."""
    import argparse
    import logging
    import socket

    from freetoken_engine.models.tokenizer import Tokenizer
    from freetoken_engine.scheduler.service import EngineService
    from freetoken_engine.server import serve
    from scripted import ScriptedService
    ran = []
    monkeypatch.setattr(EngineService, "start", classmethod(lambda cls, cfg: ScriptedService(Tokenizer(tiny_dir))))
    class Server:
        def __init__(self, config):
            self.host = config.host

        def run(self, sockets):
            ran.append(self.host)

    monkeypatch.setattr(serve, "_Server", Server)
    monkeypatch.setattr(serve, "listening_socket", lambda host, port: socket.socket())
    args = argparse.Namespace(host=host, port=1919, api_key=key, admin_token=None, model=tiny_dir)
    caplog.set_level(logging.WARNING)
    assert serve.serve_main(args) == 0 and ran == [host]
    assert any("without --api-key" in r.getMessage() for r in caplog.records) == warned


async def test_admin_token_is_required_when_set(tiny_service):
    app = create_app(tiny_service, ServerConfig(admin_token="s3cret"))
    async with asgi(app, ("10.1.2.3", 4000)) as remote:
        assert (await remote.get("/admin/cache")).status_code == 401
        assert (await remote.get("/admin/cache", headers={"Authorization": "Bearer no"})).status_code == 403
        ok = await remote.get("/admin/cache", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and "expert_cache" in ok.json()


async def test_the_api_key_is_rotated_by_the_admin_endpoint_without_a_restart(tiny_service):
    app = create_app(tiny_service, ServerConfig(api_key="old", admin_token="s3cret"))
    admin = {"Authorization": "Bearer s3cret"}
    async with asgi(app, ("10.1.2.3", 4000)) as c:
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer old"})).status_code == 200
        assert (await c.post("/admin/api-key", json={"api_key": "new"})).status_code == 401      # admin only
        assert (await c.post("/admin/api-key", json={"api_key": "new"},
                             headers={"Authorization": "Bearer old"})).status_code == 403  # not with the API key
        for bad in ({"api_key": ""}, {"api_key": "a b"}, {}, {"api_key": None}):
            r = await c.post("/admin/api-key", json=bad, headers=admin)
            assert r.status_code == 422, bad                                  # never removed
        r = await c.post("/admin/api-key", json={"api_key": "new"}, headers=admin)
        assert r.status_code == 200 and "new" not in r.text
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer old"})).status_code == 401
        assert (await c.get("/v1/models", headers={"x-api-key": "new"})).status_code == 200


async def test_oversized_body_is_413_before_it_is_read(tiny_service):
    app = create_app(tiny_service, ServerConfig(max_body_bytes=4096))
    async with asgi(app) as c:
        r = await c.post("/v1/messages", content=b"x" * 10_000,
                         headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["type"] == "error"


async def test_health_and_inference_while_loading_and_after_a_failed_load(tiny_dir):
    from freetoken_engine.models.tokenizer import Tokenizer
    from scripted import ScriptedService
    svc = ScriptedService(Tokenizer(tiny_dir))
    app = create_app(svc, ServerConfig())
    async with asgi(app) as c:
        svc.health_state = {"status": "loading", "progress": 0.25, "error": None}
        r = await c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "loading", "progress": 0.25}
        r = await c.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS})
        assert r.status_code == 503 and "loading (25%)" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "2"
        svc.health_state = {"status": "error", "progress": 0.0, "error": "no such file"}
        r = await c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "error", "error": "no such file"}
        svc.health_state = {"status": "ok", "progress": 1.0, "error": None}
        assert (await c.get("/health")).json() == {"status": "ok", "model": "tiny"}
