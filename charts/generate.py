"""Generate the chart's derived files; tests/operator/test_chart.py checks they are up to date.

    python charts/generate.py           # rewrite charts/freetoken/crds/* and dashboards/*.json

- ``charts/freetoken/crds/``: byte-identical copies of ``crds/*.yaml`` (the single source).
- ``charts/freetoken/dashboards/{fleet,node}.json``: Grafana dashboards built from the panel
  tables below. Metric names are the ones ``engine/freetoken_engine/metrics.py`` and
  ``node_agent/freetoken_agent/metrics.py`` declare (engine series carry ``node`` and ``model``
  labels added by the agent, which re-exports them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "freetoken"
RI = "$__rate_interval"

# Queries that need hardware some nodes lack: (PCIe bandwidth and per-GPU VRAM need a GPU,
# PSI needs a kernel with /proc/pressure). The Prometheus test allows them to be empty.
HARDWARE_DEPENDENT = ("pcie_bytes_per_second", "vram_used_bytes", "vram_total_bytes", "psi_")


def hit_rate(sel: str = "") -> str:
    hits = f"rate(freetoken_expert_cache_hits_total{sel}[{RI}])"
    misses = f"rate(freetoken_expert_cache_misses_total{sel}[{RI}])"
    return (f"sum by (node, model) ({hits}) / clamp_min(sum by (node, model) ({hits} + {misses}), 1e-9)")


def ttft_p95(sel: str = "") -> str:
    return (f"histogram_quantile(0.95, sum by (le, model) "
            f"(rate(freetoken_time_to_first_token_seconds_bucket{sel}[{RI}])))")


def pressure_events(sel: str = "") -> str:
    return (f"sum by (node, action) (increase(freetoken_agent_pressure_events_total[{RI}]) "
            f"* on (instance, job) group_left (node) freetoken_agent_info{sel})")


# (title, type, unit, [(expr, legend)], width)
FLEET = [
    ("Nodes reporting", "stat", "none", [("count(freetoken_agent_info)", "nodes")], 6),
    ("Replicas ready", "stat", "none", [('sum(freetoken_agent_replicas{state="ready"})', "ready")], 6),
    ("Nodes under memory pressure", "stat", "none", [("sum(freetoken_agent_memory_pressure)", "pressured")], 6),
    ("Engines answering", "stat", "none", [("sum(freetoken_agent_engine_up)", "up")], 6),
    ("Tokens/s per node and model", "timeseries", "short",
     [(f"sum by (node, model) (rate(freetoken_generation_tokens_total[{RI}]))", "{{node}} {{model}}")], 12),
    ("Time to first token p95", "timeseries", "s", [(ttft_p95(), "{{model}}")], 12),
    ("Expert cache hit rate", "timeseries", "percentunit", [(hit_rate(), "{{node}} {{model}}")], 12),
    ("q* (share of misses filled over PCIe)", "timeseries", "percentunit",
     [("max by (node) (freetoken_agent_fill_fraction)", "{{node}}")], 12),
    ("Expert-cache memory: ours vs foreign", "timeseries", "bytes",
     [("sum by (node) (freetoken_agent_memory_ours_bytes)", "{{node}} ours"),
      ("sum by (node) (freetoken_agent_memory_foreign_bytes)", "{{node}} foreign (games, browsers)"),
      ("sum by (node) (freetoken_agent_memory_headroom_bytes)", "{{node}} headroom kept free")], 12),
    ("Bandwidth per node", "timeseries", "Bps",
     [("max by (node) (freetoken_agent_pcie_bytes_per_second)", "{{node}} PCIe"),
      ("max by (node) (freetoken_agent_cpu_expert_bytes_per_second)", "{{node}} CPU experts")], 12),
    ("Memory-pressure actions", "timeseries", "short", [(pressure_events(), "{{node}} {{action}}")], 12),
    ("Replicas by state", "timeseries", "none", [("sum by (state) (freetoken_agent_replicas)", "{{state}}")], 12),
    ("Requests running and queued", "timeseries", "none",
     [("sum by (model) (freetoken_requests_running)", "{{model}} running"),
      ("sum by (model) (freetoken_requests_queued)", "{{model}} queued")], 24),
]

N = '{node=~"$node"}'
NODE = [
    ("Memory domain", "timeseries", "bytes",
     [(f"freetoken_agent_memory_total_bytes{N}", "total"), (f"freetoken_agent_memory_used_bytes{N}", "used"),
      (f"freetoken_agent_memory_ours_bytes{N}", "ours"), (f"freetoken_agent_memory_foreign_bytes{N}", "foreign"),
      (f"freetoken_agent_memory_headroom_bytes{N}", "headroom")], 12),
    ("Expert cache per replica", "timeseries", "bytes",
     [(f"freetoken_agent_expert_cache_bytes{N}", "{{model}}"),
      (f"freetoken_agent_expert_cache_floor_bytes{N}", "{{model}} floor")], 12),
    ("Tokens/s per model", "timeseries", "short",
     [(f"sum by (model) (rate(freetoken_generation_tokens_total{N}[{RI}]))", "{{model}}")], 12),
    ("Time to first token p95", "timeseries", "s", [(ttft_p95(N), "{{model}}")], 12),
    ("Expert cache hit rate", "timeseries", "percentunit", [(hit_rate(N), "{{model}}")], 12),
    ("q*: node calibration and engines", "timeseries", "percentunit",
     [(f"freetoken_agent_fill_fraction{N}", "node"), (f"freetoken_expert_fill_fraction{N}", "{{model}}")], 12),
    ("Bandwidth", "timeseries", "Bps",
     [(f"freetoken_agent_pcie_bytes_per_second{N}", "PCIe"),
      (f"freetoken_agent_cpu_expert_bytes_per_second{N}", "CPU experts"),
      (f"freetoken_agent_concurrent_cpu_expert_bytes_per_second{N}", "CPU experts, PCIe busy")], 12),
    ("VRAM per GPU", "timeseries", "bytes", [(f"freetoken_agent_vram_used_bytes{N}", "GPU {{gpu}} used")], 12),
    ("Host memory", "timeseries", "bytes",
     [(f"freetoken_agent_host_memory_available_bytes{N}", "available"),
      (f"freetoken_agent_host_memory_total_bytes{N}", "total")], 12),
    ("Host memory pressure (PSI some)", "timeseries", "percentunit",
     [(f"freetoken_agent_host_memory_psi_some_ratio{N}", "some")], 12),
    ("KV cache usage", "timeseries", "percentunit", [(f"freetoken_kv_usage_ratio{N}", "{{model}}")], 12),
    ("Memory-pressure actions", "timeseries", "short", [(pressure_events(N), "{{action}}")], 12),
    ("Engine up", "stat", "none", [(f"freetoken_agent_engine_up{N}", "{{model}}")], 12),
    ("Replica states", "stat", "none", [(f"freetoken_agent_replica_state{N} == 1", "{{model}} {{state}}")], 12),
    ("CPU kernel workers sitting out (another process on their CPUs)", "timeseries", "short",
     [(f"freetoken_cpu_workers_left_out{N}", "{{model}} workers out"),
      (f"sum by (model) (rate(freetoken_cpu_stalled_calls_total{N}[{RI}]))", "{{model}} stalled calls/s"),
      (f"freetoken_cpu_rate_ratio{N}", "{{model}} CPU rate / its reference (GPU: q* follows it)")], 24),
    ("Decode steps from CUDA graphs (0 graphs on a GPU: decode runs eagerly)", "timeseries", "short",
     [(f"sum by (model) (rate(freetoken_decode_graph_replays_total{N}[{RI}]))", "{{model}} steps/s"),
      (f"freetoken_decode_graphs{N}", "{{model}} graphs"),
      (f"sum by (model) (rate(freetoken_decode_graph_drops_total{N}[{RI}]))", "{{model}} dropped/s (--graph-memory-gb)"),
      (f"freetoken_decode_graph_capture_failures_total{N}", "{{model}} failed captures (3: eager for good)")],
     12),
    ("Device memory taken by decode graphs (12-14 MB a graph at 48 layers; bounded by --graph-memory-gb)",
     "timeseries", "bytes",
     [(f"freetoken_decode_graph_bytes{N}", "{{model}}")], 12),
    ("Decode steps between a long prompt's layers (--decode-pause-ms)", "timeseries", "short",
     [(f"sum by (model) (rate(freetoken_decode_steps_beside_prefill_total{N}[{RI}]))", "{{model}} steps/s"),
      (f"sum by (model) (rate(freetoken_decode_beside_prefill_seconds_total{N}[{RI}]))",
       "{{model}} share of time in them")], 24),
    ("Hybrid models: prompts resumed from anchor checkpoints (--state-checkpoints)", "timeseries", "short",
     [(f"sum by (model) (rate(freetoken_anchor_resumes_total{N}[{RI}]))", "{{model}} resumes/s"),
      (f"sum by (model) (rate(freetoken_anchor_resumed_tokens_total{N}[{RI}]))", "{{model}} tokens not prefilled/s"),
      (f"freetoken_anchor_checkpoints_held{N}", "{{model}} checkpoints held")], 24),
    ("Speculative decoding: draft tokens checked and kept (--speculative-tokens; each kept one saves a pass)",
     "timeseries", "short",
     [(f"sum by (model) (rate(freetoken_speculative_draft_tokens_total{N}[{RI}]))", "{{model}} drafted/s"),
      (f"sum by (model) (rate(freetoken_speculative_kept_tokens_total{N}[{RI}]))", "{{model}} kept/s")], 24),
]


def dashboard(uid: str, title: str, panels: list, node_var: bool) -> dict:
    out, x, y = [], 0, 0
    for i, (ptitle, ptype, unit, targets, width) in enumerate(panels, start=1):
        height = 4 if ptype == "stat" else 8
        if x + width > 24:
            x, y = 0, y + height
        out.append({
            "id": i, "type": ptype, "title": ptitle,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": height, "w": width, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}} if ptype == "timeseries" else {},
            "targets": [{"refId": chr(65 + j), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, (expr, legend) in enumerate(targets)],
        })
        x += width
    variables = [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus",
                  "current": {}, "hide": 0}]
    if node_var:
        variables.append({"name": "node", "type": "query", "label": "Node",
                          "datasource": {"type": "prometheus", "uid": "${datasource}"},
                          "query": {"query": "label_values(freetoken_agent_info, node)", "refId": "nodes"},
                          "definition": "label_values(freetoken_agent_info, node)",
                          "refresh": 2, "multi": True, "includeAll": True, "current": {}, "sort": 1})
    return {"uid": uid, "title": title, "tags": ["freetoken"], "timezone": "browser", "schemaVersion": 39,
            "version": 1, "editable": True, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
            "templating": {"list": variables}, "annotations": {"list": []}, "panels": out}


def outputs() -> dict[Path, bytes]:
    """Every generated file and its exact content."""
    files = {CHART / "crds" / src.name: src.read_bytes() for src in sorted((ROOT / "crds").glob("*.yaml"))}
    for name, dash in (("fleet", dashboard("freetoken-fleet", "FreeToken fleet", FLEET, False)),
                       ("node", dashboard("freetoken-node", "FreeToken node", NODE, True))):
        files[CHART / "dashboards" / f"{name}.json"] = (json.dumps(dash, indent=2) + "\n").encode()
    return files


def main() -> int:
    (CHART / "crds").mkdir(exist_ok=True)
    (CHART / "dashboards").mkdir(exist_ok=True)
    for stale in list((CHART / "crds").glob("*.yaml")):
        if stale not in outputs():
            stale.unlink()
    for path, data in outputs().items():
        path.write_bytes(data)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
