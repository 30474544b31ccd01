"""The CPU kernel's thread pool on CPUs shared with other processes (kernels/cpu/pool.h).

A worker that another process keeps off its CPU must not hold the engine's calls: a call ends when
its chunks are done, a worker that held one up sits out the next ones for a while, and no output
bit depends on which threads took part.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from freetoken_engine.kernels import cpu_experts as ce


@pytest.fixture
def pool():
    """Two participants with long-spinning workers (a worker enters a job within microseconds);
    the kernel's config and knobs restored afterwards."""
    if not ce.available():
        pytest.skip("compiled kernel unavailable")
    cfg, knobs = ce.configure(), ce.tune()
    ce.configure(threads=2, spin_us=200_000)
    yield
    ce.tune(**knobs)
    ce.configure(threads=cfg.threads, isa=cfg.isa, prefetch_bytes=cfg.prefetch_bytes, spin_us=cfg.spin_us)


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    E, H, I = 8, 2048, 1024                  # 12.6 MB experts: calls of several ms, so a worker that a busy
                                             # machine schedules late still enters some of them
    x = torch.randn(2, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 45).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / 32).bfloat16()
    tok = torch.tensor([0] * 8 + [1] * 8)
    exp = torch.cat((torch.arange(8), torch.arange(8).flip(0)))
    return x, w13, w2, tok, exp


def _alone(x, w13, w2, tok, exp):
    ce.configure(threads=1)
    want = ce.experts_forward(x, w13, w2, tok, exp)
    ce.configure(threads=2, spin_us=200_000)
    return want


def _until_a_stall(call, want) -> float:
    """``call()`` until one waits for worker 1 (it must enter the call first, which a busy machine
    can delay), each giving ``want``; returns the clock after that call, by which time the worker
    has been left out."""
    before, end = ce.pool_stats()["stalled_calls"], time.monotonic() + 10
    while time.monotonic() < end:
        assert torch.equal(call(), want)
        if ce.pool_stats()["stalled_calls"] > before:
            assert ce.pool_stats() == {"workers_left_out": 1, "stalled_calls": before + 1}
            return time.monotonic()
    raise AssertionError("worker 1 never entered a call and held it up in 10 s")


def test_a_worker_that_holds_a_call_up_sits_out_the_next_calls(pool):
    """Worker 1 made to sleep 40 ms inside every job it enters (as if preempted mid-chunk): the
    call it enters waits for it once and leaves it out; the next calls run without it and never
    wait again while it is out; it takes part again once its time is up. Every output is bitwise
    the one-thread result."""
    x, w13, w2, tok, exp = _problem()
    want = _alone(x, w13, w2, tok, exp)
    assert ce.pool_stats() == {"workers_left_out": 0, "stalled_calls": 0}
    ce.tune(test_stall_us=40_000, stall_us=2_000, backoff_ms=1_000, backoff_max_ms=1_000)
    _until_a_stall(lambda: ce.experts_forward(x, w13, w2, tok, exp), want)
    for _ in range(10):
        assert torch.equal(ce.experts_forward(x, w13, w2, tok, exp), want)
    assert ce.pool_stats() == {"workers_left_out": 1, "stalled_calls": 1}
    ce.tune(test_stall_us=0)
    time.sleep(1.1)
    assert ce.pool_stats()["workers_left_out"] == 0
    for _ in range(5):
        assert torch.equal(ce.experts_forward(x, w13, w2, tok, exp), want)
    assert ce.pool_stats()["workers_left_out"] == 0


def test_stalling_again_right_after_coming_back_doubles_the_time_out(pool):
    """A worker that holds calls up again soon after rejoining sits out twice as long."""
    x, w13, w2, tok, exp = _problem(1)
    want = _alone(x, w13, w2, tok, exp)
    ce.tune(test_stall_us=20_000, stall_us=2_000, backoff_ms=300, backoff_max_ms=10_000)
    forward = lambda: ce.experts_forward(x, w13, w2, tok, exp)  # noqa: E731
    _until_a_stall(forward, want)                            # out for 300 ms
    time.sleep(0.35)
    after = _until_a_stall(forward, want)                    # back, stalls again: out for 600 ms
    time.sleep(max(0.0, after + 0.4 - time.monotonic()))
    assert ce.pool_stats()["workers_left_out"] == 1          # 300 ms would have ended by now
    time.sleep(max(0.0, after + 0.7 - time.monotonic()))
    assert ce.pool_stats()["workers_left_out"] == 0


def test_only_the_worker_holding_a_chunk_sits_out_not_those_waiting_for_it(pool):
    """A one-expert call: the down projection waits for the whole stage 1, so when worker 1
    stalls inside a stage-1 chunk, worker 2 and the caller wait for it inside the call. That wait
    leaves out worker 1 alone (worker 2 was only waiting), and the call's rows are the
    one-thread rows."""
    x, w13, w2, _, _ = _problem(3)
    tok, exp = torch.tensor([0]), torch.tensor([5])
    ce.configure(threads=1)
    want = ce.experts_forward(x, w13, w2, tok, exp)
    ce.configure(threads=3, spin_us=200_000)
    ce.tune(test_stall_us=30_000, stall_us=2_000, backoff_ms=2_000, backoff_max_ms=2_000)
    _until_a_stall(lambda: ce.experts_forward(x, w13, w2, tok, exp), want)   # one worker out, one stall


def test_a_worker_holding_up_a_projection_is_noticed_after_the_callers_share(pool):
    """A projection's chunks depend on nothing, so nobody waits inside the call: the caller
    notices worker 1 still on its chunk once its own share is done, and leaves it out."""
    from freetoken_engine.kernels.cpu import linear as cpu_linear
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 2048, generator=g).bfloat16(), (torch.randn(8192, 2048, generator=g) / 45).bfloat16()
    ce.configure(threads=1)
    want = cpu_linear.linear(x, w, None)
    ce.configure(threads=2, spin_us=200_000)
    ce.tune(test_stall_us=30_000, stall_us=2_000, backoff_ms=2_000, backoff_max_ms=2_000)
    _until_a_stall(lambda: cpu_linear.linear(x, w, None), want)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_outputs_hold_while_another_process_takes_the_workers_cpu(pool):
    """A busy process pinned to the CPU the worker is pinned to (the last one): it is preempted
    at any point of any call, enters late or not at all; 200 calls of every projection the
    decode makes give the one-thread outputs bit for bit."""
    x, w13, w2, tok, exp = _problem(2)
    want = _alone(x, w13, w2, tok, exp)
    from freetoken_engine.kernels.cpu import linear as cpu_linear
    w = (torch.randn(4096, 2048) / 45).bfloat16()
    ce.configure(threads=1)
    want_lin = cpu_linear.linear(x, w, None)
    ce.configure(threads=2, spin_us=200)
    last = max(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{last}}})\nwhile True: pass"])
    try:
        time.sleep(0.3)
        for _ in range(200):
            assert torch.equal(ce.experts_forward(x, w13, w2, tok, exp), want)
            assert torch.equal(cpu_linear.linear(x, w, None), want_lin)
    finally:
        hog.kill()
        hog.wait()
