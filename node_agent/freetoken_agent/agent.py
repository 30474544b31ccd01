"""``freetoken-agent run``: the node agent's event loop.

Data flow, every few hundred milliseconds to seconds::

    assignments (FreeTokenNode.spec.models | standalone YAML)
        -> reconcile: start / stop / replace one Replica (engine subprocess) per key
    NVML | simulated device | /proc/meminfo + PSI, engines' /admin/cache
        -> PressureController.tick -> policy.decide -> POST /admin/cache
    calibration (cache file | `freetoken calibrate` | an engine's /admin/calibrate)
        -> POST /admin/calibrate to every engine
    snapshot() -> FreeTokenNode.status (heartbeat) and /metrics (at scrape time)

Concurrency: one asyncio loop owns all mutable state; the metrics HTTP thread only calls
``snapshot()`` and ``engine_fetchers()``, which read immutable tuples and plain fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from datetime import datetime, timezone

from .assignments import Assignment, AssignmentError, StandaloneFile, parse_models
from .calibration import CalibrationCache, CalibrationError, HostConfig, measure
from .config import AgentConfig
from .engine_api import EngineUnreachable
from .fetch import UrlSource, prune, stored_sha256
from .host import cpu_cores
from .kube import KubeError, NodeReporter
from .metrics import AgentMetrics
from .pressure import PressureController
from .replica import LaunchConfig, Replica
from .snapshot import NodeSnapshot, ReplicaSnapshot, rfc3339, to_status

log = logging.getLogger(__name__)
KUBE_WARN_EVERY = 60.0   # seconds between warnings while the API server does not answer


def _replica_snapshot(r: Replica) -> ReplicaSnapshot:
    cache, fetched = r.cache, r.fetched or (None, None)     # each read once: other tasks update them
    return ReplicaSnapshot(
        key=r.key, model=r.assignment.model, state=r.state, endpoint=r.endpoint,
        restarts=r.restarts, message=r.message,
        expert_cache_bytes=cache.capacity_bytes if cache else None,
        expert_cache_floor_bytes=cache.min_experts * cache.expert_bytes if cache else None,
        expert_cache_max_bytes=cache.max_experts * cache.expert_bytes if cache else None,
        device=r.assignment.engine.device, fetched_bytes=fetched[0], fetch_size_bytes=fetched[1])


PRUNE_SECONDS = 600.0


class Agent:
    def __init__(self, cfg: AgentConfig, metrics: AgentMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or AgentMetrics(cfg.node_name)
        self.replicas: dict[str, Replica] = {}
        self._view: tuple[Replica, ...] = ()  # immutable copy for other threads
        self.controller = PressureController(cfg.policy, lambda: self._view, self.metrics,
                                             simulated_gpu=cfg.simulated_gpu)
        self.launch = LaunchConfig(engine_command=cfg.engine_command, bind_host=cfg.bind_host,
                                   address=cfg.address, port_offset=cfg.engine_port_offset,
                                   log_dir=cfg.log_dir, health_interval=cfg.health_interval,
                                   backoff_max=cfg.backoff_max, admin_token=cfg.admin_token,
                                   model_store=cfg.store)
        self.reporter = None if cfg.standalone else NodeReporter(cfg.node_name, cfg.kube_server)
        self.standalone = StandaloneFile(cfg.standalone) if cfg.standalone else None
        gpus = tuple(g.name for g in self.controller.gpu.read()) if self.controller.domain == "nvml" else ()
        self.host_config = HostConfig.detect(cfg.node_name, gpus)
        self.calibration_cache = CalibrationCache(cfg.state_dir)
        self.calibration: dict | None = self.calibration_cache.load(self.host_config)
        self.assignment_error: str | None = None
        self._kube_down_since: float | None = None     # the API server stopped answering (monotonic)
        self._kube_warned, self._kube_failures = 0.0, 0
        self._keys_checked = time.monotonic()
        self.key_errors: dict[str, tuple[Assignment, str]] = {}   # replicas not started: no API key yet
        self._since: dict[str, str] = {}
        self._last_flags: dict[str, bool] = {}
        self._recalibrate = asyncio.Event()
        self._next_prune = 0.0                         # monotonic time of the next model-store prune
        self.metrics.attach(self.snapshot, self.engine_fetchers)

    # ---- views for the metrics thread and the status reporter -------------------------
    def snapshot(self) -> NodeSnapshot:
        c = self.controller
        obs = c.last_obs
        replicas = tuple(_replica_snapshot(r) for r in self._view) + tuple(ReplicaSnapshot(
            key=key, model=a.model, state="failed", endpoint="", restarts=0, message=why,
            expert_cache_bytes=None, expert_cache_floor_bytes=None, expert_cache_max_bytes=None,
            device=a.engine.device) for key, (a, why) in tuple(self.key_errors.items()))
        return NodeSnapshot(
            node=self.cfg.node_name, mode=c.mode, address=self.cfg.address, domain=c.domain,
            gpus=c.last_gpus, total_bytes=obs.total_bytes if obs else 0,
            used_bytes=obs.used_bytes if obs else 0, ours_bytes=obs.ours_bytes if obs else 0,
            headroom_bytes=c.headroom_bytes(), cpu_cores=cpu_cores(),
            ram_total_bytes=c.last_host.total_bytes, ram_available_bytes=c.last_host.available_bytes,
            psi=c.last_psi, calibration=self.calibration, memory_pressure=c.memory_pressure,
            replicas=replicas, assignment_error=self.assignment_error,
            pressure_since=self._since.get("MemoryPressure"),
            assignment_since=self._since.get("AssignmentsValid"), stored_sha256=stored_sha256(self.cfg.store))

    def engine_fetchers(self):
        return [(r.key, r.client.metrics_text_sync) for r in self._view if r.state == "ready"]

    def _track(self, ctype: str, flag: bool) -> None:
        if self._last_flags.get(ctype) != flag:
            self._last_flags[ctype] = flag
            self._since[ctype] = rfc3339(datetime.now(timezone.utc))

    # ---- assignments and engines ------------------------------------------------------
    async def desired(self) -> dict[str, Assignment] | None:
        """What should run; ``None`` when it cannot be known now (keep what runs)."""
        if self.standalone is not None:
            models = self.standalone.read()
            error = self.standalone.error
            if error and error != self.assignment_error:
                log.error("%s; the engines keep the assignments read before", error)
            elif self.assignment_error and not error:
                log.info("%s is valid again", self.standalone.path)
            self.assignment_error = error
            return models
        try:
            spec = await self.reporter.read_spec()
        except KubeError as exc:
            self._kube_failed("cannot read the FreeTokenNode spec", exc)
            return None
        self._kube_ok()
        try:
            models = parse_models(spec.get("models"))
            self.assignment_error = None
            return models
        except AssignmentError as exc:
            self.assignment_error = str(exc)
            return None

    async def _api_key(self, a: Assignment) -> str | None:
        if a.api_key or a.api_key_secret is None or self.reporter is None:
            return a.api_key
        name, key = a.api_key_secret
        return await self.reporter.read_secret(a.namespace, name, key)

    def _launch_args(self, a: Assignment) -> tuple[int | None, float | None]:
        cal = self.calibration
        cpu_fraction = 1.0 - float(cal["fill_fraction"]) if cal else None
        return self.controller.launch_budget(a.engine.expert_cache_share), cpu_fraction

    async def _on_ready(self, r: Replica) -> None:
        if r.api_key and r.api_key != r.started_key:   # the Secret changed while it was starting
            await self._push_key(r)
        if self.calibration is not None:
            await self._push_calibration(r, self.calibration)

    async def _push_key(self, r: Replica) -> None:
        try:
            await r.client.set_api_key(r.api_key)
            r.started_key = r.api_key
            log.info("replica %s: API key rotated", r.key)
        except EngineUnreachable as exc:
            log.warning("replica %s: could not rotate its API key (it keeps the old one until it "
                        "restarts): %s", r.key, exc)

    async def _recheck_keys(self) -> None:
        """Every ``key_recheck_seconds``: a replica whose Secret now holds another key gets it
        pushed to its engine (the next start uses it anyway)."""
        now = time.monotonic()
        if self.reporter is None or now - self._keys_checked < self.cfg.key_recheck_seconds:
            return
        self._keys_checked = now
        for r in tuple(self.replicas.values()):
            if r.assignment.api_key_secret is None or r.assignment.api_key:
                continue
            try:
                key = await self._api_key(r.assignment)
            except KubeError as exc:
                log.warning("replica %s: cannot re-read its API key (keeps the one it has): %s", r.key, exc)
                continue
            if key and key != r.api_key:
                r.api_key = key               # every later start of the engine
                if r.state == "ready":
                    await self._push_key(r)

    def _on_restart(self, r: Replica) -> None:
        self.metrics.restart(r.key)

    async def reconcile(self) -> None:
        desired = await self.desired()
        self._track("AssignmentsValid", self.assignment_error is None)
        if desired is None:
            return
        await self._prune_store(desired)
        for key in [k for k, r in self.replicas.items() if desired.get(k) != r.assignment]:
            log.info("stopping engine %s (unassigned or changed)", key)
            await self.replicas[key].stop()  # reported until its process is gone
            del self.replicas[key]
            self._view = tuple(self.replicas.values())
        await self._recheck_keys()
        for key in [k for k in self.key_errors if k not in desired]:
            del self.key_errors[key]
        for key, a in desired.items():
            if key in self.replicas:
                continue
            try:
                api_key = await self._api_key(a)
            except KubeError as exc:
                # reported as a failed replica (the model's Degraded condition says why), and
                # tried again on every pass: the Secret may be created later
                name, field = a.api_key_secret or ("?", "?")
                why = f"cannot read its API key (Secret {a.namespace}/{name}, key {field!r}): {exc}"
                if exc.status == 403:
                    why += f" (the chart's agent.secretNamespaces must list {a.namespace!r})"
                if self.key_errors.get(key, (None, None))[1] != why:
                    log.warning("replica %s: %s", key, why)
                self.key_errors[key] = (a, why)
                continue
            self.key_errors.pop(key, None)
            r = Replica(a, self.launch, api_key=api_key, launch_args=self._launch_args,
                        on_ready=self._on_ready, on_restart=self._on_restart)
            self.replicas[key] = r
            self._view = tuple(self.replicas.values())
            r.start()

    async def _prune_store(self, desired: dict[str, Assignment]) -> None:
        """Every PRUNE_SECONDS: remove downloads no assignment names that went unused for
        FREETOKEN_AGENT_MODEL_STORE_KEEP_DAYS (fetch.prune)."""
        if time.monotonic() < self._next_prune:
            return
        self._next_prune = time.monotonic() + PRUNE_SECONDS
        keep = {UrlSource(a.url, a.sha256).key for a in desired.values() if a.url}
        days = self.cfg.model_store_keep_days
        for name in await asyncio.to_thread(prune, self.cfg.store, keep, days * 86400.0):
            log.info("model store: removed %s (no assignment uses it, unused for %g days)", name, days)

    # ---- calibration --------------------------------------------------------------------
    async def _push_calibration(self, r: Replica, cal: dict) -> None:
        # q* itself: the engine would derive it from whichever bandwidth pair it is sent, and the
        # right pair is the concurrent one, already folded into fill_fraction by the measurement.
        try:
            await r.client.calibrate({"fill_fraction": float(cal["fill_fraction"])}, timeout=30.0)
        except EngineUnreachable as exc:
            log.warning("pushing calibration to %s: %s", r.key, exc)

    async def recalibrate(self) -> None:
        """Measure (through a ready engine if there is one) and push the result everywhere."""
        ready = [r for r in self._view if r.state == "ready"]
        try:
            if ready:
                result = await ready[0].client.calibrate({"measure": True})
                source = "engine"
            else:
                result = await measure(self.cfg.engine_command, self.host_config.device, refresh=True)
                source = "subprocess"
        except (EngineUnreachable, CalibrationError, OSError) as exc:
            log.warning("calibration failed: %s", exc)
            return
        self.metrics.calibration(source)
        self.calibration = result
        if not self.calibration_cache.save(self.host_config, result):
            log.info("calibration measured while another process held the engine's CPUs "
                     "(%s stalled kernel calls): used, not cached", result.get("cpu_stalled_calls"))
        await asyncio.gather(*(self._push_calibration(r, result) for r in ready))

    async def _calibration_loop(self) -> None:
        if self.calibration is None and self.cfg.calibrate_on_start:
            await self.recalibrate()
        interval = self.cfg.calibrate_interval or None
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow the shutdown's
            # cancel when a SIGUSR1 lands at the same moment, and this loop has no other way out
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._recalibrate.wait()
            self._recalibrate.clear()
            await self.recalibrate()

    # ---- loops --------------------------------------------------------------------------
    async def _pressure_loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.controller.tick()
                self._track("MemoryPressure", self.controller.memory_pressure)
            except Exception:  # never let one bad reading stop the protection of the owner
                log.exception("pressure tick failed")
            await asyncio.sleep(max(0.0, self.cfg.tick_seconds - (time.monotonic() - started)))

    async def _reconcile_loop(self) -> None:
        period = 1.0 if self.standalone is not None else min(2.0, self.cfg.heartbeat_seconds)
        while True:
            try:
                await self.reconcile()
            except Exception:
                log.exception("reconcile failed")
            await asyncio.sleep(period)

    async def report(self) -> None:
        try:
            await self.reporter.patch_status(to_status(self.snapshot()))
            self.metrics.heartbeat(True)
            self._kube_ok()
        except KubeError as exc:
            self.metrics.heartbeat(False)
            self._kube_failed("status update failed", exc)

    def _kube_failed(self, what: str, exc: Exception) -> None:
        """One warning when the API server stops answering, then one a minute while it stays so
        (the spec is read every 2 s and the status written every heartbeat)."""
        now = time.monotonic()
        self._kube_failures += 1
        if self._kube_down_since is None or now - self._kube_warned >= KUBE_WARN_EVERY:
            again = "" if self._kube_down_since is None else f" (still, {self._kube_failures} failures " \
                f"in {now - self._kube_down_since:.0f} s)"
            log.warning("%s: %s%s", what, exc, again)
            self._kube_warned = now
        if self._kube_down_since is None:
            self._kube_down_since = now

    def _kube_ok(self) -> None:
        if self._kube_down_since is not None:
            log.info("the Kubernetes API answers again after %.0f s", time.monotonic() - self._kube_down_since)
        self._kube_down_since, self._kube_failures = None, 0

    async def _heartbeat_loop(self) -> None:
        while True:
            await self.report()
            await asyncio.sleep(self.cfg.heartbeat_seconds)

    async def run(self, stop: asyncio.Event | None = None, serve_metrics: bool = True) -> None:
        """Run until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None)."""
        loop = asyncio.get_running_loop()
        if stop is None:
            stop = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            loop.add_signal_handler(signal.SIGUSR1, self._recalibrate.set)
        if serve_metrics:
            self.metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
        if self.reporter is not None:
            while not stop.is_set():
                try:
                    await self.reporter.ensure_node()
                    self._kube_ok()
                    break
                except KubeError as exc:
                    self._kube_failed(f"cannot create FreeTokenNode {self.cfg.node_name}", exc)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), 2.0)
        await self.controller.tick()  # a first reading before any engine starts
        loops = [self._pressure_loop(), self._reconcile_loop(), self._calibration_loop()]
        if self.reporter is not None:
            loops.append(self._heartbeat_loop())
        tasks = [asyncio.create_task(c) for c in loops]
        try:
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(r.stop() for r in self.replicas.values()))
            if self.reporter is not None:
                await self.report()  # replicas now read "stopped"
                self.reporter.close()
            self.controller.close()
