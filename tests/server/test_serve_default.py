"""``freetoken serve`` as a user runs it: the real CLI in a subprocess, the embedded default
model (SmolLM2-135M-Instruct as an MoE), the official clients, a clean shutdown on Ctrl-C."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "freetoken_engine.cli", "serve", "--port", str(port),
         "--api-key", KEY, "--served-model-name", NAME],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"freetoken serve exited: {proc.stdout.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).json().get("status") == "ok":
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("freetoken serve did not become healthy")
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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


def test_ctrl_c_stops_the_server_cleanly(served):
    url, proc = served
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
