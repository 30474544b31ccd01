"""The pressure controller: read memory, run the policy, resize the engines' caches.

One ``tick()`` = read every ready engine's ``/admin/cache``, read the memory domain (GPU 0
through NVML or the simulated device; host RAM in CPU mode), call the pure
``policy.decide``, and apply its targets with ``POST /admin/cache`` to all engines at once.
The reaction time of a shrink, from the memory reading to the last engine answering with
its smaller cache (the engine answers once the new size is in force), goes to the
``freetoken_agent_pressure_reaction_seconds`` histogram.

Which engines' caches live in which domain: a ``cuda`` engine holds ``device_bytes`` of VRAM;
a ``cpu`` engine's cache is host memory, which the simulated device stands in for (tests) and
the host domain measures (CPU mode). On a real GPU, CPU engines are not resized.

Only the agent's event loop calls ``tick``; the metrics thread reads the ``last_*`` fields.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from .engine_api import CacheInfo, EngineUnreachable
from .gpu import GpuError, GpuReading, GpuSource, open_gpu_source
from .host import HostMemory, Psi, read_meminfo, read_psi
from .metrics import AgentMetrics
from .policy import CacheState, Decision, Observation, PolicyConfig, PolicyState, decide
from .replica import Replica

log = logging.getLogger(__name__)


class PressureController:
    def __init__(self, policy: PolicyConfig, replicas: Callable[[], tuple[Replica, ...]],
                 metrics: AgentMetrics, simulated_gpu: str | None = None,
                 gpu: GpuSource | None = None) -> None:
        self.policy = policy
        self._replicas = replicas
        self._metrics = metrics
        self.gpu = gpu if gpu is not None else open_gpu_source(self.ours_bytes, simulated_gpu)
        self.domain = "host" if self.gpu is None else self.gpu.kind
        self.mode = "gpu" if self.domain == "nvml" else "cpu"
        self.state = PolicyState()
        self.last_gpus: tuple[GpuReading, ...] = ()
        self.last_host = HostMemory(0, 0)
        self.last_psi: Psi | None = None
        self.last_obs: Observation | None = None
        self.last_decision: Decision | None = None
        self.last_reaction_seconds: float | None = None
        self.memory_pressure = False
        self._last_reason = ""

    def counts_here(self, cache: CacheInfo) -> bool:
        """Whether an engine's cache lives in this controller's memory domain."""
        if self.domain == "nvml":
            return cache.device == "cuda"
        if self.domain == "host":
            return cache.device == "cpu"
        return True

    def footprint(self, cache: CacheInfo) -> int:
        """Bytes an engine holds in this domain: its device bytes on a GPU, else its cache."""
        return cache.device_bytes if cache.device == "cuda" else cache.capacity_bytes

    def ours_bytes(self) -> int:
        return sum(self.footprint(r.cache) for r in self._replicas()
                   if r.cache is not None and self.counts_here(r.cache))

    def headroom_bytes(self) -> int:
        total = self.last_obs.total_bytes if self.last_obs else 0
        return self.policy.headroom(total)

    def launch_budget(self, share: float) -> int | None:
        """Expert-cache bytes for an engine about to start: ``share`` of the free memory above
        the headroom. ``None`` before the first reading (the engine picks its default)."""
        obs = self.last_obs
        if obs is None:
            return None
        return max(0, int(share * (obs.free_bytes - self.policy.headroom(obs.total_bytes))))

    async def _refresh_caches(self, ready: list[Replica]) -> None:
        async def one(r: Replica) -> None:
            if r.resize_lock.locked():
                return  # a resize is in flight; its answer will update r.cache
            try:
                r.cache = await r.client.cache()
            except EngineUnreachable as exc:
                log.debug("engine %s: %s", r.key, exc)
        await asyncio.gather(*(one(r) for r in ready))

    def _read_memory(self) -> tuple[int, int]:
        try:
            self.last_host = read_meminfo()
        except OSError:
            pass
        self.last_psi = read_psi()
        if self.gpu is None:
            return self.last_host.total_bytes, self.last_host.used_bytes
        self.last_gpus = tuple(self.gpu.read())
        g = self.last_gpus[0]
        return g.total_bytes, g.used_bytes

    async def _resize(self, r: Replica, target: int) -> None:
        async with r.resize_lock:
            try:
                r.cache = await r.client.resize(target)
            except EngineUnreachable as exc:
                log.warning("resize of %s to %d B failed: %s", r.key, target, exc)

    async def tick(self) -> Decision | None:
        """One observation and decision; ``None`` when memory could not be read."""
        ready = [r for r in self._replicas() if r.serving]
        await self._refresh_caches(ready)
        t0 = time.monotonic()
        try:
            total, used = self._read_memory()
        except GpuError as exc:
            log.warning("%s", exc)
            return None
        members = [r for r in ready if r.cache is not None and self.counts_here(r.cache)]
        obs = Observation(
            now=t0, total_bytes=total, used_bytes=used,
            ours_bytes=sum(self.footprint(r.cache) for r in members),
            caches=tuple(CacheState(r.key, r.cache.capacity_bytes, r.cache.expert_bytes,
                                    r.cache.min_experts, r.cache.max_experts) for r in members),
            psi_some_avg10=self.last_psi.some_avg10 if self.last_psi and self.domain == "host" else None)
        decision = decide(self.policy, obs, self.state)
        self.state, self.last_obs, self.last_decision = decision.state, obs, decision
        self.memory_pressure = decision.memory_pressure
        if decision.reason != self._last_reason:  # what the policy thinks, once per change
            self._last_reason = decision.reason
            log.debug("%s: %s (free %d B, headroom %d B, ours %d B)", decision.action, decision.reason,
                      obs.free_bytes, self.policy.headroom(total), obs.ours_bytes)
        if decision.targets:
            by_key = {r.key: r for r in members}
            await asyncio.gather(*(self._resize(by_key[k], v) for k, v in decision.targets.items()))
            self._metrics.pressure_event(decision.action)
            if decision.action == "shrink":
                self.last_reaction_seconds = time.monotonic() - t0
                self._metrics.reaction.observe(self.last_reaction_seconds)
            log.info("%s: %s (%s)", decision.action, decision.targets, decision.reason)
        return decision

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()
