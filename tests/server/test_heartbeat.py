"""A stream that has nothing to send yet (a long prompt still prefilling) sends heartbeats, so
proxies and agents with idle timeouts keep the request: Anthropic's own ``ping`` event on
``/v1/messages``, an SSE comment on the OpenAI routes. The official clients read the streams
as before."""
from __future__ import annotations

import httpx
import pytest

from live import live_server
from freetoken_engine.models.tokenizer import Tokenizer
from scripted import ScriptedService

ANSWER = "Slow but steady."
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def slow(tiny_dir):
    """Each token comes 0.12 s after the last; heartbeats after 0.02 s of silence."""
    service = ScriptedService(Tokenizer(tiny_dir), script=lambda prompt: ANSWER, delay_s=0.12)
    with live_server(service, heartbeat_s=0.02) as srv:
        yield srv


def raw_lines(srv, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", srv.url + path, json=dict(body, model=srv.model, stream=True), timeout=30) as r:
        assert r.status_code == 200
        return list(r.iter_lines())


def test_anthropic_streams_ping_events_while_waiting_and_the_client_reads_the_text(slow):
    lines = raw_lines(slow, "/v1/messages", {"messages": MSGS, "max_tokens": 50})
    events = [line[7:] for line in lines if line.startswith("event: ")]
    first_delta = events.index("content_block_delta")
    assert "ping" in events[:first_delta] and events[-1] == "message_stop"
    with slow.anthropic().messages.stream(model=slow.model, max_tokens=50, messages=MSGS) as stream:
        assert stream.get_final_text() == ANSWER


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": MSGS}),
                                        ("/v1/responses", {"input": "hi"}),
                                        ("/v1/completions", {"prompt": "hi", "max_tokens": 50})])
def test_openai_routes_send_comments_while_waiting(slow, path, body):
    lines = raw_lines(slow, path, body)
    data = [i for i, line in enumerate(lines) if line.startswith("data: ")]
    beats = [i for i, line in enumerate(lines) if line == ": keep-alive"]
    assert beats and beats[0] < data[2]          # before the first token's chunk


def test_the_openai_clients_read_the_streams_with_heartbeats(slow):
    client = slow.openai()
    chunks = client.chat.completions.create(model=slow.model, messages=MSGS, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    with client.responses.stream(model=slow.model, input="hi") as stream:
        assert stream.get_final_response().output_text == ANSWER
