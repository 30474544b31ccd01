"""torch's threads during a CPU engine's passes (executor/host_threads.py): decode passes of at
most 8 rows run torch's small ops on one thread (its OpenMP team would otherwise spin on the
cores the compiled kernel's workers need), prompts on all of them, and the caller gets its own
count back when a call returns. The tokens do not change."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.executor import host_threads as ht
from freetoken_engine.executor.inputs import SeqChunk
from freetoken_engine.llm import Lockstep

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
PROMPT = list(range(3, 40))          # 37 tokens: a prefill pass of more than 8 rows


@pytest.fixture
def three_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(before)


def chunks(rows: int) -> list[SeqChunk]:
    return [SeqChunk([0], 0, [1]) for _ in range(rows)]


def test_small_passes_take_one_thread_and_restore_gives_the_callers_count_back(three_threads):
    h = ht.HostThreads(full=3)
    with h.for_pass(chunks(8)):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 1            # sticky: the sampler after the pass runs on one too
    with h.for_pass([SeqChunk([0, 1, 2], 0, list(range(9)))]):
        assert torch.get_num_threads() == 3        # a prompt of 9 rows: all of them
    with h.for_pass(chunks(2)):
        pass
    h.restore()
    assert torch.get_num_threads() == 3


def test_scoped_mode_puts_the_count_back_after_each_pass(three_threads):
    h = ht.HostThreads(full=3, sticky=False)
    with h.for_pass(chunks(4)):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 3


def test_the_engine_decodes_on_one_thread_and_returns_the_callers_count(tiny_checkpoint, three_threads,
                                                                         monkeypatch):
    folder = tiny_checkpoint("qwen3_moe")
    llm = LLM(folder, dtype="float32")
    assert llm.runner.host_threads is not None and llm.runner.host_threads.full == 3
    seen = []                                   # (rows, torch threads) of each pass
    run = llm.runner._run

    def spy(chunks, key, between):
        seen.append((sum(len(c.tokens) for c in chunks), torch.get_num_threads()))
        return run(chunks, key, between)

    monkeypatch.setattr(llm.runner, "_run", spy)
    got = llm.generate(PROMPT, GREEDY).token_ids
    assert torch.get_num_threads() == 3
    assert seen[0] == (len(PROMPT), 3)
    assert {t for _, t in seen[1:]} == {1} and len(seen) == GREEDY.max_new_tokens
    steps = Lockstep(llm, [PROMPT, PROMPT[5:]])
    steps.step()
    assert torch.get_num_threads() == 1
    steps.close()
    assert torch.get_num_threads() == 3
    seen.clear()
    monkeypatch.setattr(llm.runner, "host_threads", None)     # torch's threads left alone: same tokens
    assert llm.generate(PROMPT, GREEDY).token_ids == got
    assert {t for _, t in seen} == {3}


def test_a_cpu_engine_without_its_compiled_kernels_leaves_torchs_threads_alone(monkeypatch):
    from freetoken_engine.kernels import cpu_experts
    monkeypatch.setattr(cpu_experts, "available", lambda: False)
    assert ht.for_engine(torch.device("cpu")) is None
    assert ht.for_engine(torch.device("cuda")) is None


@pytest.mark.parametrize("own", [None, "ACTIVE"])
def test_importing_the_engine_before_torch_lets_idle_openmp_workers_sleep(own):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if own is not None:
        env["OMP_WAIT_POLICY"] = own                  # the user's own setting stays
    code = "import freetoken_engine, os; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == (own or "PASSIVE")


@pytest.mark.parametrize("first,own,warns", [("torch", None, True), ("torch", "ACTIVE", False),
                                             ("freetoken_engine", None, False)])
def test_a_cpu_engine_says_so_when_torch_loaded_first_with_spinning_workers(tiny_checkpoint, first, own, warns):
    """torch imported first with the variable unset: its OpenMP workers spin (prompts up to 2-3x
    slower on a 16-core host), and the engine's one warning says what to set; a user's own value,
    or the engine imported first, gets none."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if own is not None:
        env["OMP_WAIT_POLICY"] = own
    code = (f"import {first}, torch, freetoken_engine\n"
            "torch.set_num_threads(2)\n"
            f"freetoken_engine.LLM({str(tiny_checkpoint('qwen3_moe'))!r}, dtype='float32')\n"
            "print(freetoken_engine.TORCH_FIRST)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(warns)
    said = [line for line in out.stderr.splitlines() if "OMP_WAIT_POLICY" in line]
    assert len(said) == (1 if warns else 0), out.stderr
    if warns:
        assert "OMP_WAIT_POLICY=PASSIVE" in said[0]
