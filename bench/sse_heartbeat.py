"""What the server's stream heartbeat costs per chunk: a plain async iteration, the heartbeat as
built (``streaming.with_heartbeat``: one reader task and a queue), and the first version (a task
and an ``asyncio.wait`` per chunk), in the same process, rounds interleaved.

Workload: an async generator of ``--chunks`` one-character chunks, each after an
``asyncio.sleep(0)`` (a token arriving); no heartbeat ever fires (10 s). Median microseconds
per chunk over the rounds.

    python bench/sse_heartbeat.py [--chunks 50000] [--rounds 5] [--out bench/results/sse_heartbeat.json]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import describe  # noqa: E402
from report import save  # noqa: E402

from freetoken_engine.server.streaming import with_heartbeat  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


async def tokens(n: int):
    for _ in range(n):
        await asyncio.sleep(0)
        yield "x"


async def per_chunk_task(chunks, beat: str, every_s: float):
    """The first version: a task and a wait for every chunk."""
    it, pending = chunks.__aiter__(), None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield beat
                continue
            step, pending = pending, None
            try:
                chunk = step.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        if pending is not None:
            pending.cancel()


SIDES = {"plain iteration": lambda g: g,
         "with_heartbeat (reader task + queue)": lambda g: with_heartbeat(g, "b", 10.0),
         "per-chunk task + wait (first version)": lambda g: per_chunk_task(g, "b", 10.0)}


async def run(chunks: int, rounds: int) -> dict:
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for _ in range(rounds):
        for side, wrap in SIDES.items():
            t = time.perf_counter()
            n = 0
            async for _ in wrap(tokens(chunks)):
                n += 1
            assert n == chunks
            times[side].append((time.perf_counter() - t) / chunks * 1e6)
    return {side: {"us_per_chunk_median": statistics.median(v), "rounds": v} for side, v in times.items()}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sides = list(result["sides"])
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.barh(sides, [result["sides"][s]["us_per_chunk_median"] for s in sides])
    ax.set_xlabel("us per chunk (median)")
    ax.set_title(f"SSE heartbeat cost: {str(result['hardware'].get('cpu', ''))[:60]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "sse_heartbeat.json")
    args = ap.parse_args()
    sides = asyncio.run(run(args.chunks, args.rounds))
    print(f"{'side':42s} {'us/chunk (median)':>18s}")
    for side, r in sides.items():
        print(f"{side:42s} {r['us_per_chunk_median']:18.1f}")
    save({"benchmark": "sse_heartbeat", "hardware": describe(), "chunks": args.chunks, "sides": sides},
         args.out, plot)


if __name__ == "__main__":
    main()
