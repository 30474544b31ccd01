"""Every Prometheus metric the agent exports, declared here and nowhere else.

Two kinds of metric:

* **State** (gauges: memory, bandwidths, cache sizes, replica states) is read from the agent's
  ``NodeSnapshot`` at scrape time by ``SnapshotCollector``: nothing is copied on a timer.
* **Events** (pressure actions, reaction seconds, restarts) are counters and a histogram in
  ``AgentMetrics``, updated where the event happens.

``EngineCollector`` re-exports each engine's own ``/metrics`` (names ``freetoken_*``) with two
labels added, ``node`` and ``model`` (the replica key; it replaces an engine label of the same
name), so one dashboard covers the fleet. Each ``AgentMetrics`` owns its own
``CollectorRegistry``: tests build as many agents as they like.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from .snapshot import NodeSnapshot

log = logging.getLogger(__name__)

P = "freetoken_agent_"
# name -> help. Gauges read from the snapshot at scrape time.
GAUGES = {
    "info": "Agent identity; value 1. Labels: node, mode (gpu|cpu), domain (nvml|simulated|host).",
    "memory_total_bytes": "Total bytes of the memory domain holding the expert caches.",
    "memory_used_bytes": "Used bytes of that domain (device level, as nvidia-smi shows).",
    "memory_ours_bytes": "Bytes of that domain held by this agent's engines.",
    "memory_foreign_bytes": "Bytes of that domain used by other processes (used - ours).",
    "memory_headroom_bytes": "Free bytes the policy keeps for the node's owner.",
    "vram_total_bytes": "Total VRAM per GPU.",
    "vram_used_bytes": "Used VRAM per GPU.",
    "host_memory_total_bytes": "Host MemTotal.",
    "host_memory_available_bytes": "Host MemAvailable.",
    "host_memory_psi_some_ratio": "PSI memory 'some' avg10 as a ratio (0..1); absent without PSI.",
    "host_memory_psi_full_ratio": "PSI memory 'full' avg10 as a ratio (0..1); absent without PSI.",
    "cpu_cores": "CPU cores available to the agent and its engines.",
    "pcie_bytes_per_second": "Calibrated host-to-device bandwidth (alone); absent without a GPU.",
    "cpu_expert_bytes_per_second": "Calibrated CPU expert-kernel weight bandwidth (alone).",
    "concurrent_pcie_bytes_per_second": "PCIe bandwidth while the CPU expert kernel runs too.",
    "concurrent_cpu_expert_bytes_per_second": "CPU expert bandwidth while PCIe copies run too.",
    "fill_fraction": "q*/m: share of cache misses filled over PCIe (the rest computed on the CPU).",
    "memory_pressure": "1 when caches are at their floor and free memory is still below the headroom.",
    "expert_cache_bytes": "Expert-cache capacity per replica.",
    "expert_cache_floor_bytes": "Smallest expert cache the replica's engine accepts.",
    "expert_cache_max_bytes": "Largest useful expert cache (all experts resident).",
    "replica_state": "1 for the replica's current state (starting|ready|failed|stopped).",
    "model_fetched_bytes": "Bytes of a source.url model downloaded so far, while its replica fetches it.",
    "model_fetch_size_bytes": "Size of that download; absent when the server does not send it.",
    "replicas": "Number of replicas per state.",
}
STATES = ("starting", "ready", "failed", "stopped")
REACTION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class AgentMetrics:
    """The event metrics and the registry everything is exposed from. Every event metric
    carries the ``node`` label too, like the state metrics, so fleet queries need no join."""

    def __init__(self, node: str, registry: CollectorRegistry | None = None) -> None:
        self.node = node
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._pressure_events = Counter(P + "pressure_events", "Cache resizes decided by the pressure policy.",
                                        ["node", "action"], registry=r)  # exposed as ..._total
        self._reaction = Histogram(
            P + "pressure_reaction_seconds",
            "From reading memory below the headroom to every engine reporting its smaller cache.",
            ["node"], buckets=REACTION_BUCKETS, registry=r)
        self._restarts = Counter(P + "engine_restarts", "Engine processes restarted after a failure.",
                                 ["node", "model"], registry=r)
        self._calibrations = Counter(P + "calibrations", "Calibration measurements taken.",
                                     ["node", "source"], registry=r)
        self._heartbeats = Counter(P + "heartbeats", "FreeTokenNode status updates written.",
                                   ["node", "result"], registry=r)
        for action in ("shrink", "grow"):
            self._pressure_events.labels(node, action)  # export zeros before the first event
        for result in ("ok", "error"):
            self._heartbeats.labels(node, result)
        self.reaction = self._reaction.labels(node)

    def pressure_event(self, action: str) -> None:
        self._pressure_events.labels(self.node, action).inc()

    def restart(self, model: str) -> None:
        self._restarts.labels(self.node, model).inc()

    def calibration(self, source: str) -> None:
        self._calibrations.labels(self.node, source).inc()

    def heartbeat(self, ok: bool) -> None:
        self._heartbeats.labels(self.node, "ok" if ok else "error").inc()

    def attach(self, snapshot: Callable[[], NodeSnapshot | None],
               engines: Callable[[], Iterable[tuple[str, Callable[[], str]]]]) -> None:
        """Register the scrape-time collectors: the agent's state and its engines' metrics."""
        self.registry.register(SnapshotCollector(snapshot))
        self.registry.register(EngineCollector(snapshot, engines))

    def serve(self, host: str, port: int):
        """Start the ``/metrics`` HTTP server in a daemon thread; returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)


def _gauge(name: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, GAUGES[name], labels=list(labels))


class SnapshotCollector:
    def __init__(self, snapshot: Callable[[], NodeSnapshot | None]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list:
        return []  # dynamic: do not let the registry call collect() at registration

    def collect(self) -> Iterable[Metric]:
        s = self._snapshot()
        if s is None:
            return
        node = (s.node,)
        g = _gauge("info", ("node", "mode", "domain"))
        g.add_metric([s.node, s.mode, s.domain], 1)
        yield g
        for name, value in (("memory_total_bytes", s.total_bytes), ("memory_used_bytes", s.used_bytes),
                            ("memory_ours_bytes", s.ours_bytes), ("memory_foreign_bytes", s.foreign_bytes),
                            ("memory_headroom_bytes", s.headroom_bytes),
                            ("host_memory_total_bytes", s.ram_total_bytes),
                            ("host_memory_available_bytes", s.ram_available_bytes),
                            ("cpu_cores", s.cpu_cores), ("memory_pressure", int(s.memory_pressure))):
            g = _gauge(name, ("node",))
            g.add_metric(node, value)
            yield g
        if s.psi is not None:
            for name, value in (("host_memory_psi_some_ratio", s.psi.some_avg10),
                                ("host_memory_psi_full_ratio", s.psi.full_avg10)):
                g = _gauge(name, ("node",))
                g.add_metric(node, value / 100.0)
                yield g
        if s.gpus:
            total, used = _gauge("vram_total_bytes", ("node", "gpu", "name")), _gauge("vram_used_bytes", ("node", "gpu", "name"))
            for r in s.gpus:
                total.add_metric([s.node, str(r.index), r.name], r.total_bytes)
                used.add_metric([s.node, str(r.index), r.name], r.used_bytes)
            yield total
            yield used
        cal = s.calibration or {}
        conc = cal.get("concurrent") or {}
        for name, value in (("pcie_bytes_per_second", cal.get("pcie_gbps")),
                            ("cpu_expert_bytes_per_second", cal.get("cpu_expert_gbps")),
                            ("concurrent_pcie_bytes_per_second", conc.get("pcie_gbps")),
                            ("concurrent_cpu_expert_bytes_per_second", conc.get("cpu_expert_gbps"))):
            if value is not None:
                g = _gauge(name, ("node",))
                g.add_metric(node, float(value) * 1e9)
                yield g
        if cal.get("fill_fraction") is not None:
            g = _gauge("fill_fraction", ("node",))
            g.add_metric(node, float(cal["fill_fraction"]))
            yield g
        yield from self._replicas(s)

    @staticmethod
    def _replicas(s: NodeSnapshot) -> Iterable[Metric]:
        labels = ("node", "model")
        sizes = {n: _gauge(n, labels) for n in
                 ("expert_cache_bytes", "expert_cache_floor_bytes", "expert_cache_max_bytes",
                  "model_fetched_bytes", "model_fetch_size_bytes")}
        state = _gauge("replica_state", ("node", "model", "state"))
        counts = dict.fromkeys(STATES, 0)
        for r in s.replicas:
            for n, v in (("expert_cache_bytes", r.expert_cache_bytes),
                         ("expert_cache_floor_bytes", r.expert_cache_floor_bytes),
                         ("expert_cache_max_bytes", r.expert_cache_max_bytes),
                         ("model_fetched_bytes", r.fetched_bytes), ("model_fetch_size_bytes", r.fetch_size_bytes)):
                if v is not None:
                    sizes[n].add_metric([s.node, r.key], v)
            for st in STATES:
                state.add_metric([s.node, r.key, st], int(r.state == st))
            counts[r.state] = counts.get(r.state, 0) + 1
        total = _gauge("replicas", ("node", "state"))
        for st, n in counts.items():
            total.add_metric([s.node, st], n)
        yield from sizes.values()
        yield state
        yield total


class EngineCollector:
    """Each engine's ``/metrics``, fetched at scrape time and relabelled with node and model."""

    def __init__(self, snapshot: Callable[[], NodeSnapshot | None],
                 engines: Callable[[], Iterable[tuple[str, Callable[[], str]]]]) -> None:
        self._snapshot = snapshot
        self._engines = engines

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable[Metric]:
        s = self._snapshot()
        node = s.node if s is not None else ""
        merged: dict[str, Metric] = {}
        up = GaugeMetricFamily(P + "engine_up", "1 when the engine's /metrics answered this scrape.",
                               labels=["node", "model"])
        for key, fetch in self._engines():
            try:
                families = list(text_string_to_metric_families(fetch()))
            except Exception as exc:  # unreachable engine or unparsable text: report, go on
                log.debug("engine %s metrics: %s", key, exc)
                up.add_metric([node, key], 0)
                continue
            up.add_metric([node, key], 1)
            for fam in families:
                if not fam.name.startswith("freetoken_") or fam.name.startswith(P):
                    continue
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for sample in fam.samples:
                    out.add_sample(sample.name, {**sample.labels, "node": node, "model": key},
                                   sample.value, sample.timestamp)
        yield up
        yield from merged.values()
