"""Repetition penalties and min-p: each against its definition on hand-made logits, the running
counts against a count from scratch, and through the scheduler equal to ``LLM.generate``."""
from __future__ import annotations

import asyncio
import re

import pytest
import torch

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.config import EngineConfig
from freetoken_engine.errors import InvalidRequest
from freetoken_engine.executor.penalties import Penalties
from freetoken_engine.executor.sampler import sample
from freetoken_engine.scheduler.service import EngineService

V = 16


def logits(**values) -> torch.Tensor:
    x = torch.zeros(V)
    for k, v in values.items():
        x[int(k[1:])] = v
    return x


def greedy(x, history=(), prompt=(), **kw) -> int:
    params = SamplingParams(temperature=0, **kw)
    p = Penalties(params, list(prompt), V)
    for t in history:
        p.add(t)
    return sample(x, params, torch.Generator(), p)


def test_presence_and_frequency_follow_openais_definition():
    x = logits(t5=2.0, t7=1.0)                       # token 5 leads by 1.0
    assert greedy(x, [5], presence_penalty=0.9) == 5             # 2.0 - 0.9 > 1.0
    assert greedy(x, [5], presence_penalty=1.1) == 7
    assert greedy(x, [5], frequency_penalty=0.6) == 5            # one occurrence: -0.6
    assert greedy(x, [5, 5], frequency_penalty=0.6) == 7         # two: -1.2
    assert greedy(x, [5, 5], presence_penalty=-1.0) == 5         # negative: encourages
    assert greedy(x, prompt=[5], presence_penalty=2.0) == 5      # the prompt does not count


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    x = logits(t5=2.0, t7=1.5, t9=-0.1)
    x[torch.arange(V) > 9] = -1.0
    x[0:5] = -1.0
    x[6], x[8] = -1.0, -1.0
    assert greedy(x, prompt=[5], repetition_penalty=1.2) == 5    # 2.0 / 1.2 > 1.5
    assert greedy(x, prompt=[5], repetition_penalty=2.0) == 7    # 1.0 < 1.5
    y = logits(t3=-0.5, t4=-0.45)
    y[y == 0] = -5.0
    assert greedy(y, prompt=[4], repetition_penalty=1.5) == 3    # -0.45 * 1.5 < -0.5


def test_min_p_drops_the_unlikely_tail():
    x = torch.full((V,), -4.0)
    x[3], x[8] = 2.0, 1.8
    params = SamplingParams(temperature=1.0, min_p=0.5)
    gen = torch.Generator().manual_seed(0)
    drawn = {sample(x, params, gen) for _ in range(400)}
    assert drawn == {3, 8}
    free = {sample(x, SamplingParams(temperature=1.0), gen) for _ in range(400)}
    assert free - {3, 8}                                         # without min_p the tail shows up


def test_running_counts_equal_a_count_from_scratch():
    params = SamplingParams(presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.3)
    prompt, out = [1, 2, 2, 9], [4, 4, 4, 7, 1]
    p = Penalties(params, prompt, V)
    for t in out:
        p.add(t)
    x = torch.randn(V)
    want = x.clone()
    for t in set(prompt) | set(out):
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t in set(out):
        want[t] -= 0.2 * out.count(t) + 0.3
    p.apply(x)
    assert torch.allclose(x, want)


@pytest.mark.parametrize("kw, says", [({"presence_penalty": 2.5}, "-2..2"), ({"repetition_penalty": 0}, "(0, 10]"),
                                      ({"min_p": 1.5}, "0..1")])
def test_out_of_range_values_say_the_range(kw, says):
    with pytest.raises(InvalidRequest, match=re.escape(says)):
        SamplingParams(**kw)


async def test_penalised_output_is_the_same_through_the_scheduler(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")
    prompt = [5, 17, 99, 200, 3, 44, 12, 300]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, presence_penalty=1.5,
                            frequency_penalty=0.5, repetition_penalty=1.2)
    llm = LLM(folder)
    alone = llm.generate(prompt, params).token_ids
    plain = llm.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)).token_ids
    assert alone != plain
    assert len(set(alone)) > len(set(plain))             # fewer repeats
    svc = EngineService.start(EngineConfig(model=folder, max_batch=4), wait=True)
    try:
        async def run():
            return [ev.token_id async for ev in svc.submit(prompt, params) if ev.token_id is not None]
        got = await asyncio.gather(run(), run())
    finally:
        svc.shutdown()
    assert got == [alone, alone]
