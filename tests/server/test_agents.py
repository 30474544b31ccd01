"""Coding agents' real requests, replayed: Codex CLI on ``/v1/responses`` and Claude Code on
``/v1/messages``.

``data/codex_0.171.0_turn{1,2}.json`` and ``data/claude_code_2.1.197_turn{1,2}.json`` are the
request bodies those agents sent to this server for "Run the command echo HELLO-$((1+1)) and tell
me what it printed" (``codex exec``, ``claude -p``; long texts shortened, client metadata
dropped): turn 1 with the agent's own messages and tools (Codex: developer messages, function
tools, a ``namespace`` of sub-agent tools, ``web_search``; Claude Code: a system message between
the turns, adaptive thinking, ``context_management``, ``cache_control``), turn 2 with the call
the model made and the agent's tool result. Replayed against a model whose answers are fixed,
the server must answer each as it did then: a shell call, then the text. A template that
takes a system message only first (Qwen3.5's) gets Claude Code's as a user message.

With ``FREETOKEN_CODEX`` / ``FREETOKEN_CLAUDE`` naming an agent's binary (``npm install
@openai/codex @anthropic-ai/claude-code``), the last tests run the real agents through the same
loop against a live server.
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
PROMPT = "Run the command echo HELLO-$((1+1)) and tell me what it printed"
ANSWER = "The command printed HELLO-2."
CALLS = {"exec_command": {"cmd": "echo HELLO-$((1+1))"},
         "Bash": {"command": "echo HELLO-$((1+1))", "description": "Print the sum"}}
STRICT = ("{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
          "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}"
          "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def script(prompt: str) -> str:
    """The shell call in the agent's own tool, until the prompt holds the command's output."""
    if "HELLO-2" in prompt.replace("HELLO-$((1+1))", ""):
        return ANSWER
    tool = "exec_command" if '"exec_command"' in prompt else "Bash"
    return "Running it. <tool_call>" + json.dumps({"name": tool, "arguments": CALLS[tool]}) + "</tool_call>"


def _serve(folder: Path):
    prompts = []

    def answer(prompt: str) -> str:
        prompts.append(prompt)
        return script(prompt)
    server = live_server(ScriptedService(Tokenizer(folder), script=answer, max_context=100_000), api_key="k")
    return server, prompts


@pytest.fixture(scope="module")
def server(tiny_dir):
    cm, prompts = _serve(tiny_dir)
    with cm as srv:
        srv.prompts = prompts
        yield srv


def events(server, path: str, body: dict) -> list[dict]:
    """The SSE events of one streamed request, as the agents read them."""
    out, kind = [], None
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60, headers={"x-api-key": "k"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] == kind
                out.append(ev)
    return out


def turn(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def test_codex_turns_replayed_get_the_call_then_the_answer(server):
    evs = events(server, "/v1/responses", turn("codex_0.171.0_turn1.json"))
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert evs[0]["type"] == "response.created" and evs[-1]["type"] == "response.completed"
    output = evs[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert output[1]["name"] == "exec_command" and json.loads(output[1]["arguments"]) == CALLS["exec_command"]
    prompt = server.prompts[-1]
    assert prompt.count("<|im_start|>system") == 2         # the tools' block and one merged system message
    assert '"name": "multi_agent_v1.close_agent"' in prompt and '"web_search"' not in prompt

    final = events(server, "/v1/responses", turn("codex_0.171.0_turn2.json"))[-1]["response"]
    assert final["status"] == "completed" and [i["type"] for i in final["output"]] == ["message"]
    assert final["output"][0]["content"][0]["text"] == ANSWER
    prompt = server.prompts[-1]
    assert prompt.index('"name": "exec_command"') < prompt.index("\nHELLO-2\n")      # the call, then its output


def test_claude_code_turns_replayed_get_the_call_then_the_answer(server):
    evs = events(server, "/v1/messages", turn("claude_code_2.1.197_turn1.json"))
    assert evs[0]["type"] == "message_start" and evs[-1]["type"] == "message_stop"
    blocks = [e["content_block"] for e in evs if e["type"] == "content_block_start"]
    assert [b["type"] for b in blocks] == ["text", "tool_use"] and blocks[1]["name"] == "Bash"
    args = "".join(e["delta"]["partial_json"] for e in evs if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "input_json_delta")
    assert json.loads(args) == CALLS["Bash"]
    assert [e["delta"]["stop_reason"] for e in evs if e["type"] == "message_delta"] == ["tool_use"]
    late_system = turn("claude_code_2.1.197_turn1.json")["messages"][1]["content"]
    assert "<|im_start|>system" + late_system + "<|im_end|>" in server.prompts[-1]     # where Claude Code put it

    evs = events(server, "/v1/messages", turn("claude_code_2.1.197_turn2.json"))
    text = "".join(e["delta"]["text"] for e in evs if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta")
    assert text == ANSWER
    assert [e["delta"]["stop_reason"] for e in evs if e["type"] == "message_delta"] == ["end_turn"]


def test_a_template_that_takes_system_only_first_gets_claude_codes_as_user(tiny_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=STRICT)))
    cm, prompts = _serve(tmp_path)
    body = turn("claude_code_2.1.197_turn1.json")
    with cm as srv:
        events(srv, "/v1/messages", body)
    assert "<|im_start|>user\n" + body["messages"][1]["content"] + "<|im_end|>" in prompts[-1]
    assert prompts[-1].startswith("<|im_start|>system\n")                       # the top-level system


def _run_agent(env_name: str, args: list[str], env: dict, cwd: Path) -> str:
    r = subprocess.run([os.environ[env_name], *args, PROMPT], cwd=cwd, env=dict(os.environ, **env),
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip()


@pytest.mark.skipif(not os.environ.get("FREETOKEN_CODEX"), reason="set FREETOKEN_CODEX to a Codex CLI binary")
def test_the_real_codex_runs_a_command_through_the_server(server, tmp_path):
    config = {"model": '"tiny"', "model_provider": '"ft"', "model_providers.ft.name": '"FT"',
              "model_providers.ft.base_url": f'"{server.url}/v1"', "model_providers.ft.env_key": '"FT_KEY"',
              "model_providers.ft.wire_api": '"responses"'}
    args = ["exec", "--skip-git-repo-check"] + [a for key, value in config.items() for a in ("-c", f"{key}={value}")]
    (tmp_path / "home").mkdir()
    out = _run_agent("FREETOKEN_CODEX", args, {"CODEX_HOME": str(tmp_path / "home"), "FT_KEY": "k"}, tmp_path)
    assert out.endswith(ANSWER)


@pytest.mark.skipif(not os.environ.get("FREETOKEN_CLAUDE"), reason="set FREETOKEN_CLAUDE to a Claude Code binary")
def test_the_real_claude_code_runs_a_command_through_the_server(server, tmp_path):
    env = {"HOME": str(tmp_path), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "k",
           "ANTHROPIC_MODEL": "tiny", "ANTHROPIC_SMALL_FAST_MODEL": "tiny", "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    assert _run_agent("FREETOKEN_CLAUDE", ["--allowedTools=Bash", "-p"], env, tmp_path) == ANSWER


def test_an_image_in_a_tool_result_becomes_a_note_and_the_session_goes_on(server):
    """Claude Code's Read on an image file and Codex's view_image return image parts; the
    models served here read text only, so the part becomes a note instead of a 400."""
    png = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    claude = {"model": "tiny", "max_tokens": 50, "messages": [
        {"role": "user", "content": "Look at logo.png"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "logo.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "logo.png:"}, {"type": "image", "source": png}]}]}]}
    r = httpx.post(f"{server.url}/v1/messages", json=claude, headers={"x-api-key": "k"}, timeout=30)
    assert r.status_code == 200, r.text
    assert "logo.png:[image omitted: this model reads text only]" in server.prompts[-1]
    codex = {"model": "tiny", "input": [
        {"role": "user", "content": "Look at logo.png"},
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": '{"path": "logo.png"}'},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}]}
    r = httpx.post(f"{server.url}/v1/responses", json=codex, headers={"x-api-key": "k"}, timeout=30)
    assert r.status_code == 200, r.text
    assert "[image omitted: this model reads text only]" in server.prompts[-1]
    user_image = dict(claude, messages=[{"role": "user", "content": [{"type": "image", "source": png}]}])
    r = httpx.post(f"{server.url}/v1/messages", json=user_image, headers={"x-api-key": "k"}, timeout=30)
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]   # the user's own image: told
