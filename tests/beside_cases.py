"""What the CPU and GPU tests of the decode steps beside a long pass share (scheduler/beside.py):
three short prompts and a long one admitted in the same step, a pause that is always due, and
the tokens emitted while each long pass ran."""
from __future__ import annotations

import asyncio
import itertools
import threading

from freetoken_engine import SamplingParams
from freetoken_engine.scheduler.beside import DecodePause
from freetoken_engine.scheduler.service import EngineService

LAYERS = 6                      # 5 layer boundaries a pass
LONG = [3 + (7 * i) % 300 for i in range(300)]
SHORT = [[5, 17, 99, 200, 3, 44, 12, 300, 8, 9, 77, 150, 31, 60 + i] for i in range(3)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def always_due(svc: EngineService) -> None:
    """Every pass of at least the threshold leaves the decoders out (no pause: every pass takes
    at least that long), and every layer boundary runs their step (a clock that jumps 10 s a
    reading)."""
    svc.scheduler.pause = DecodePause(0.0, svc.runner.device, clock=itertools.count(0.0, 10.0).__next__)


def count_tokens_inside_long_passes(svc: EngineService) -> list[tuple[int, int]]:
    """For each pass of more than 16 tokens: the tokens the scheduler emitted while it ran, and
    the sequences it carried."""
    runner, counters, inside = svc.runner, svc.scheduler.counters, []
    forward = runner.forward

    def counted(chunks, between=None):
        before = counters["generated_tokens"]
        logits = forward(chunks, between)
        if sum(len(c.tokens) for c in chunks) > 16:
            inside.append((counters["generated_tokens"] - before, len(chunks)))
        return logits
    runner.forward = counted
    return inside


async def run_all(svc: EngineService) -> tuple[list[list[int]], list[int]]:
    """The three short prompts and the long one, admitted in the same step (submitted while the
    scheduler waits between two passes). With a 100-token prefill step the passes carry 100
    (the short prompts and the long one's first 58), 100, 100 and 42 prompt tokens."""
    held, go = threading.Event(), threading.Event()
    svc.scheduler.call(lambda: (held.set(), go.wait(10)))     # the scheduler waits between passes
    assert held.wait(10)
    handles = [svc.submit(p, greedy(24)) for p in SHORT] + [svc.submit(LONG, greedy(4))]
    go.set()

    async def tokens(h):
        return [ev.token_id async for ev in h if ev.token_id is not None]
    got = await asyncio.wait_for(asyncio.gather(*(tokens(h) for h in handles)), 120)
    return got[:3], got[3]
