"""Every Prometheus metric the engine exports is declared here, and only here.

Two kinds:

- *Event* metrics, updated by the HTTP layer as requests finish: requests by endpoint and
  status, time to first token, time per output token, request latency, prompt / generated /
  cached tokens.
- *State* metrics, read from the ``EngineService`` at scrape time by ``_EngineCollector``
  (``svc.stats()`` and ``svc.cache_stats()``): running and queued requests, KV blocks, the
  prefix-cache hit ratio, expert-cache capacity / hits / misses / fills / CPU-computed experts,
  the fill fraction q*/m and the bandwidths behind it, device memory.

``EngineMetrics`` owns a private ``CollectorRegistry`` (one per app, so tests never share
state); ``render()`` is the ``/metrics`` body. Labels are bounded: ``endpoint`` is one of
``ENDPOINTS`` and ``status`` an HTTP status code.
"""
from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

ENDPOINTS = ("chat", "completions", "responses", "messages", "count_tokens", "models", "health",
             "metrics", "admin", "other")
_ROUTE_ENDPOINT = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                   "/v1/responses": "responses", "/v1/messages": "messages",
                   "/v1/messages/count_tokens": "count_tokens", "/v1/models": "models",
                   "/health": "health", "/metrics": "metrics"}

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)

# (name, help, key in svc.stats()) for gauges read at scrape time
_STATS_GAUGES = (
    ("freetoken_requests_running", "Requests being prefilled or decoded", "running"),
    ("freetoken_requests_queued", "Requests waiting for a slot or KV space", "queued"),
    ("freetoken_kv_blocks_total", "Paged KV pool size in blocks", "kv_blocks_total"),
    ("freetoken_kv_blocks_used", "KV blocks in use (running requests and cached prefixes)",
     "kv_blocks_used"),
    ("freetoken_kv_window_blocks_total", "Sliding-window layers' own KV store, in blocks (0: none)",
     "kv_window_blocks_total"),
    ("freetoken_kv_window_blocks_used", "Blocks of that store holding keys a window can still read",
     "kv_window_blocks_used"),
    ("freetoken_prefix_cache_hit_ratio", "Share of prompt tokens served from the prefix cache",
     "prefix_hit_ratio"),
    ("freetoken_anchor_checkpoints_held", "Hybrid models: recurrent-state checkpoints held at anchors now",
     "anchor_checkpoints_held"),
)
# (name without _total, help, key in stats()) for counters
_STATS_COUNTERS = (
    ("freetoken_preemptions", "Running requests pushed back to the queue to free KV blocks", "preemptions"),
    ("freetoken_decode_steps_beside_prefill",
     "Decode steps run between the layers of a long prefill pass (--decode-pause-ms)", "decode_steps_beside"),
    ("freetoken_decode_beside_prefill_seconds",
     "Time those decode steps took, in the middle of the prefill passes", "decode_beside_seconds"),
    ("freetoken_anchor_checkpoints",
     "Hybrid models: recurrent-state checkpoints written at anchors (turn ends, thinking blocks, tool calls)",
     "anchor_checkpoints"),
    ("freetoken_anchor_resumes", "Hybrid models: requests that resumed from an anchor checkpoint", "anchor_resumes"),
    ("freetoken_anchor_resumed_tokens", "Hybrid models: prompt tokens not prefilled again thanks to them",
     "anchor_resumed_tokens"),
    ("freetoken_speculative_draft_tokens", "Speculative decoding: draft tokens verified (n-gram or MTP; --speculative-tokens)",
     "draft_tokens"),
    ("freetoken_speculative_kept_tokens", "Speculative decoding: draft tokens the model agreed with (each saves a pass)",
     "draft_tokens_kept"),
)
# (name without _total, help, key in cache_stats()["expert_cache"]) for counters
_EXPERT_COUNTERS = (
    ("freetoken_expert_cache_hits", "Routed experts found in the expert cache", "hits"),
    ("freetoken_expert_cache_misses", "Routed experts not in the expert cache", "misses"),
    ("freetoken_expert_cache_fills",
     "Experts copied into the cache (PCIe on GPU), copies into its bypass slots included", "fills"),
    ("freetoken_expert_cpu_computed", "Missed experts computed on the CPU where they live",
     "cpu_computed"),
)
_EXPERT_GAUGES = (
    ("freetoken_expert_cache_capacity_experts", "Expert-cache slots", "capacity_experts"),
    ("freetoken_expert_cache_capacity_bytes", "Expert-cache size in bytes", "capacity_bytes"),
    ("freetoken_expert_fill_fraction", "q*/m: share of cache misses filled over PCIe",
     "fill_fraction"),
)


class _EngineCollector:
    """Reads the service at scrape time; a service that is not ready exports only readiness."""

    def __init__(self, service, model_name: str):
        self.service, self.model_name = service, model_name

    def collect(self):
        ready = GaugeMetricFamily("freetoken_engine_ready",
                                  "1 when the model is loaded and serving", labels=["model"])
        health = self.service.health()
        name = self.model_name or str(getattr(self.service, "model_name", ""))
        ready.add_metric([name], 1.0 if health.get("status") == "ok" else 0.0)
        yield ready
        if health.get("status") != "ok":
            return
        try:
            stats, cache = self.service.stats() or {}, self.service.cache_stats() or {}
        except Exception:  # a scrape must never fail because the engine is mid-change
            log.exception("metrics: reading engine stats failed")
            return
        for name, doc, key in _STATS_GAUGES:
            if stats.get(key) is not None:
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))
        if stats.get("decode_graphs") is not None:
            yield GaugeMetricFamily("freetoken_decode_graphs",
                                    "Decode steps captured as CUDA graphs (0: decode runs eagerly)",
                                    value=float(stats["decode_graphs"]))
            yield CounterMetricFamily("freetoken_decode_graph_replays",
                                      "Decode steps replayed from a captured CUDA graph",
                                      value=float(stats["decode_graph_replays"]))
            yield GaugeMetricFamily("freetoken_decode_graph_bytes",
                                    "Device memory the decode graphs took (measured at capture and first replay)",
                                    value=float(stats.get("decode_graph_bytes", 0)))
            yield CounterMetricFamily("freetoken_decode_graph_drops",
                                      "Decode graphs dropped to keep their memory under --graph-memory-gb",
                                      value=float(stats.get("decode_graph_drops", 0)))
            yield CounterMetricFamily("freetoken_decode_graph_capture_failures",
                                      "Decode graph captures that failed (each drops the graphs; "
                                      "after 3 decode stays eager)",
                                      value=float(stats.get("decode_graph_capture_failures", 0)))
        for name, doc, key in _STATS_COUNTERS:
            if stats.get(key) is not None:
                yield CounterMetricFamily(name, doc, value=float(stats[key]))
        kv = cache.get("kv") or {}
        total, used = kv.get("blocks_total"), kv.get("blocks_used")
        if total:
            yield GaugeMetricFamily("freetoken_kv_usage_ratio", "KV blocks used / total",
                                    value=float(used or 0) / float(total))
        experts = cache.get("expert_cache") or {}
        for name, doc, key in _EXPERT_COUNTERS:
            if experts.get(key) is not None:
                yield CounterMetricFamily(name, doc, value=float(experts[key]))
        for name, doc, key in _EXPERT_GAUGES:
            if experts.get(key) is not None:
                yield GaugeMetricFamily(name, doc, value=float(experts[key]))
        follow = experts.get("cpu_contention")
        if follow:
            yield GaugeMetricFamily("freetoken_cpu_rate_ratio",
                                    "The CPU kernel's measured rate over its reference while another process "
                                    "holds some of its CPUs (1: not contended); q* follows it",
                                    value=float(follow["cpu_rate_ratio"]))
        for key, name, doc in (
                ("pcie_gbps", "freetoken_pcie_bandwidth_bytes_per_second",
                 "Host-to-device expert copy bandwidth used for q*"),
                ("cpu_expert_gbps", "freetoken_cpu_expert_bandwidth_bytes_per_second",
                 "CPU expert-compute bandwidth (weights read per second) used for q*")):
            value = stats.get(key)
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=float(value) * 1e9)
        from .kernels import cpu_experts
        pool = cpu_experts.pool_stats()
        if pool:
            yield GaugeMetricFamily("freetoken_cpu_workers_left_out",
                                    "CPU kernel workers sitting out calls after holding one up "
                                    "(another process on their CPU)", value=float(pool["workers_left_out"]))
            yield CounterMetricFamily("freetoken_cpu_stalled_calls",
                                      "CPU kernel calls that waited for a worker another process kept off its CPU",
                                      value=float(pool["stalled_calls"]))
        if cache.get("device_bytes") is not None:
            yield GaugeMetricFamily("freetoken_device_memory_bytes",
                                    "Bytes the engine holds on the GPU (0 on CPU)",
                                    value=float(cache["device_bytes"]))


class EngineMetrics:
    """All engine metrics on a private registry (see the module docstring)."""

    def __init__(self, service, model_name: str = ""):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("freetoken_http_requests_total", "HTTP requests by endpoint and "
                                "status", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("freetoken_time_to_first_token_seconds", "Arrival to first "
                              "generated token", ["endpoint"], buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("freetoken_time_per_output_token_seconds", "Mean time between "
                              "output tokens of a request", ["endpoint"], buckets=_TPOT_BUCKETS,
                              registry=r)
        self.latency = Histogram("freetoken_request_duration_seconds", "Arrival to last token",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("freetoken_prompt_tokens_total", "Prompt tokens of "
                                     "finished requests", registry=r)
        self.cached_tokens = Counter("freetoken_prompt_cached_tokens_total", "Prompt tokens "
                                     "served from the prefix cache", registry=r)
        self.generated_tokens = Counter("freetoken_generation_tokens_total", "Generated tokens",
                                        registry=r)
        r.register(_EngineCollector(service, model_name))

    @staticmethod
    def endpoint_of(path: str) -> str:
        if path.startswith("/admin/"):
            return "admin"
        if path.startswith("/v1/models"):
            return "models"
        return _ROUTE_ENDPOINT.get(path, "other")

    def observe_request(self, path: str, status: int) -> None:
        self.requests.labels(self.endpoint_of(path), str(status)).inc()

    def observe_generation(self, gen) -> None:
        """Called once per finished or aborted generation (``server.generation.Generation``)."""
        end = time.monotonic()
        self.prompt_tokens.inc(gen.prompt_tokens)
        self.cached_tokens.inc(gen.cached_tokens)
        self.generated_tokens.inc(gen.completion_tokens)
        if gen.t_first is None:
            return
        self.ttft.labels(gen.endpoint).observe(gen.t_first - gen.t_arrival)
        self.latency.labels(gen.endpoint).observe(end - gen.t_arrival)
        if gen.completion_tokens > 1:
            gap = (end - gen.t_first) / (gen.completion_tokens - 1)
            self.tpot.labels(gen.endpoint).observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
