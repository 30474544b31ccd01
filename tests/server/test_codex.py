"""Codex CLI against ``/v1/responses``: its real requests, replayed.

``data/codex_0.171.0_turn{1,2}.json`` are the two request bodies Codex CLI 0.171.0 sent to this
server for ``codex exec "Run the command echo HELLO-$((1+1)) and tell me what it printed"``
(long texts shortened, ``client_metadata`` dropped): turn 1 with its developer messages and its
tools (function tools, a ``namespace`` of sub-agent tools, ``web_search``), turn 2 with the
call the model made, and Codex's ``function_call_output``. Replayed against a model whose
answers are fixed, the server must answer each as it did then: a shell call, then the text.

With ``FREETOKEN_CODEX`` naming a Codex binary (``npm install @openai/codex``), the last test
runs the real Codex against a live server through the same loop.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from live import live_server
from freetoken_engine.models.tokenizer import Tokenizer
from scripted import ScriptedService

DATA = Path(__file__).parent / "data"
CALL = '<tool_call>{"name": "exec_command", "arguments": {"cmd": "echo HELLO-$((1+1))"}}</tool_call>'


def script(prompt: str) -> str:
    return "The command printed HELLO-2." if "\nHELLO-2\n" in prompt else "Running it. " + CALL


@pytest.fixture(scope="module")
def server(tiny_dir):
    prompts = []

    def answer(prompt: str) -> str:
        prompts.append(prompt)
        return script(prompt)
    with live_server(ScriptedService(Tokenizer(tiny_dir), script=answer, max_context=100_000), api_key="k") as srv:
        srv.prompts = prompts
        yield srv


def events(server, body: dict) -> list[dict]:
    """The SSE events of one streamed request, as Codex reads them."""
    out, kind = [], None
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=60,
                      headers={"Authorization": "Bearer k"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] == kind
                out.append(ev)
    return out


def test_codex_turns_replayed_get_the_call_then_the_answer(server):
    first = json.loads((DATA / "codex_0.171.0_turn1.json").read_text())
    evs = events(server, first)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert evs[0]["type"] == "response.created" and evs[-1]["type"] == "response.completed"
    output = evs[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert output[1]["name"] == "exec_command" and output[1]["arguments"] == '{"cmd": "echo HELLO-$((1+1))"}'
    prompt = server.prompts[-1]
    assert prompt.count("<|im_start|>system") == 2         # the tools' block and one merged system message
    assert '"name": "multi_agent_v1.close_agent"' in prompt and '"web_search"' not in prompt

    second = json.loads((DATA / "codex_0.171.0_turn2.json").read_text())
    evs = events(server, second)
    final = evs[-1]["response"]
    assert final["status"] == "completed" and [i["type"] for i in final["output"]] == ["message"]
    assert final["output"][0]["content"][0]["text"] == "The command printed HELLO-2."
    prompt = server.prompts[-1]
    assert prompt.index('"name": "exec_command"') < prompt.index("HELLO-2\n")      # the call, then its output


@pytest.mark.skipif(not os.environ.get("FREETOKEN_CODEX"), reason="set FREETOKEN_CODEX to a Codex CLI binary")
def test_the_real_codex_runs_a_command_through_the_server(server, tmp_path):
    config = {"model": '"tiny"', "model_provider": '"ft"', "model_providers.ft.name": '"FT"',
              "model_providers.ft.base_url": f'"{server.url}/v1"', "model_providers.ft.env_key": '"FT_KEY"',
              "model_providers.ft.wire_api": '"responses"'}
    args = [os.environ["FREETOKEN_CODEX"], "exec", "--skip-git-repo-check"]
    for key, value in config.items():
        args += ["-c", f"{key}={value}"]
    env = dict(os.environ, CODEX_HOME=str(tmp_path / "home"), FT_KEY="k")
    (tmp_path / "home").mkdir()
    r = subprocess.run(args + ["Run the command echo HELLO-$((1+1)) and tell me what it printed"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("The command printed HELLO-2.")
