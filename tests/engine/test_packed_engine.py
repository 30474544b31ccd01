"""The engine loads the pre-packed format (``freetoken convert``) with the same output as the
Hugging Face folder it came from, and refuses a corrupt one before anything is half-loaded."""
from __future__ import annotations

import subprocess
import sys

from freetoken_engine import LLM, SamplingParams

PROMPT = [5, 17, 99, 200, 3, 44, 12, 300, 8, 9]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def test_packed_folder_generates_the_same_tokens(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen2_moe")
    out = tmp_path / "packed"
    r = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "convert", "--model", str(src),
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    want = LLM(src).generate(PROMPT, GREEDY).token_ids
    llm = LLM(out, expert_cache_experts=3, cpu_expert_fraction=0.5)
    assert llm.generate(PROMPT, GREEDY).token_ids == want
    assert llm.tokenizer is not None                 # the folder stands alone


def test_corrupt_packed_folder_is_one_clear_error(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3_moe")
    out = tmp_path / "packed"
    subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "convert", "--model", str(src),
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    shard = max((p for p in out.rglob("*") if p.is_file() and p.suffix not in (".json",)), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "generate", "--model", str(out),
                        "--prompt-ids", "1,2", "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "corrupt" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
