"""The reconcile loop: observe -> plan -> desired -> apply, on every event and on a steady tick.

One ``Reconciler`` per operator process, living on kopf's event loop. ``poke()`` (from watch
handlers) asks for a pass soon; the tick (``resync_seconds``) catches time-only changes such as
a heartbeat going stale. Passes never overlap (an asyncio lock); the blocking API writes run in a
worker thread so the loop keeps serving kopf. A failed pass is logged and retried on the next tick.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

from .apply import Applier
from .config import OperatorConfig
from .observe import Store, model_view
from .plan import Plan, plan
from .status import desired

log = logging.getLogger(__name__)


class Reconciler:
    def __init__(self, config: OperatorConfig, store: Store, applier: Applier) -> None:
        self.config, self.store, self.applier = config, store, applier
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self.passes = 0

    def poke(self) -> None:
        self._wake.set()

    async def stop(self, task: asyncio.Task) -> None:
        """Stop ``run``'s ``task`` between passes. A pass that is writing finishes first: its API
        calls run in a worker thread, which a cancel would leave calling the API server after the
        operator has gone (and holding the process's exit until they return). Each call is bounded
        by ``api_timeout_seconds``, so this wait is bounded too; past twice that (a pass makes many
        calls) the task is cancelled regardless.

        A flag, not a cancel, ends the loop: Python 3.11's ``asyncio.wait_for`` can swallow a
        cancel that lands as its awaitable completes, and the loop then ran on into a pass."""
        self._stopping.set()
        done, _ = await asyncio.wait({task}, timeout=2 * self.config.api_timeout_seconds)
        if not done:
            task.cancel()
            await asyncio.wait({task}, timeout=self.config.api_timeout_seconds)

    async def _wait(self, event: asyncio.Event, seconds: float) -> None:
        """Until ``event`` is set or the stop flag is, at most ``seconds``."""
        waits = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._stopping.wait())}
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def run(self) -> None:
        """Loop until ``stop`` (or a cancel). Failed passes back off 1, 2, 4 ... 30 s."""
        failures = 0
        while not self._stopping.is_set():
            await self._wait(self._wake, self.config.resync_seconds)
            if self._wake.is_set():
                await asyncio.sleep(0.05)   # coalesce a burst of watch events into one pass
            if self._stopping.is_set():
                return
            self._wake.clear()
            try:
                await self.reconcile_once()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception:   # noqa: BLE001 - keep the loop alive and retry
                failures += 1
                delay = min(30.0, 2.0 ** (failures - 1))
                log.exception("reconcile pass failed (%d in a row); retrying in %gs", failures, delay)
                await self._wait(self._stopping, delay)

    async def reconcile_once(self, now: dt.datetime | None = None) -> Plan:
        async with self._lock:
            now = now or dt.datetime.now(dt.timezone.utc)
            models = {}
            views = []
            for ref, body in self.store.models.items():
                try:
                    views.append(model_view(body))
                    models[ref] = body
                except (KeyError, ValueError, TypeError) as exc:
                    log.warning("FreeTokenModel %s/%s skipped, bad spec: %s", *ref, exc)
            nodes = self.store.node_views(now)
            result = plan(views, nodes, self.store.previous_placements(),
                          stale_seconds=self.config.stale_seconds, base_port=self.config.base_port)
            state = desired(models, nodes, result, stale_seconds=self.config.stale_seconds, now=now)
            written = await asyncio.to_thread(self.applier.apply, state, dict(self.store.nodes), models)
            for body in written["nodes"]:
                self.store.put_node(body, now=now)
            for body in written["models"]:
                self.store.put_model(body)
            for d in result.decisions:
                log.info("%s %s on %s: %s", d.action, d.model, d.node, d.reason)
            self.passes += 1
            return result
