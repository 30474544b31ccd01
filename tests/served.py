"""Requests through a live engine service (the scheduler's passes: prompts' chunks beside other
requests' decode steps), for tests that compare them with each request run alone."""
from __future__ import annotations

import asyncio

from freetoken_engine.config import EngineConfig
from freetoken_engine.scheduler.service import EngineService


async def served_tokens(folder, prompts: list[list[int]], params, **config) -> list[list[int]]:
    """Each prompt's generated tokens, every request submitted at once to one service on
    ``folder`` with ``config`` (``EngineConfig`` options)."""
    svc = EngineService.start(EngineConfig(model=folder, **config), wait=True)
    try:
        async def run(ids):
            return [ev.token_id async for ev in svc.submit(ids, params) if ev.token_id is not None]
        return list(await asyncio.gather(*(run(p) for p in prompts)))
    finally:
        svc.shutdown()
