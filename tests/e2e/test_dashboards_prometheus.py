"""Every query of the Grafana dashboards, run against the real Prometheus server scraping real
node agents (``freetoken-agent run``), each supervising a real engine (``freetoken serve``) on a
tiny checkpoint, after real chat requests. One agent has a simulated GPU and a seeded PCIe
calibration, the other runs in cpu mode, so both kinds of node feed the panels."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import httpx
import pytest
import yaml

import fleet
from freetoken_agent.calibration import CalibrationCache, HostConfig

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "charts" / "freetoken" / "dashboards"
# Queries that need what a CI machine may lack (kept in step with charts/generate.py).
HARDWARE_DEPENDENT = ("pcie_bytes_per_second", "vram_used_bytes", "vram_total_bytes", "psi_", "cpu_rate_ratio")


def panel_queries() -> list[tuple[str, str, str]]:
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                out.append((path.stem, panel["title"], target["expr"]))
    return out


def prometheus_rule_spec() -> dict:
    """The chart's PrometheusRule ``spec`` (alert groups) as rendered with the default thresholds."""
    import helm_python as helm

    out = helm.Chart.load(ROOT / "charts" / "freetoken").render(
        {"monitoring": {"prometheusRule": {"enabled": True}}}, name="ft", namespace="ft")
    docs = yaml.safe_load_all(out["freetoken/templates/monitoring.yaml"])
    return next(d for d in docs if d and d["kind"] == "PrometheusRule")["spec"]


def concrete(expr: str) -> str:
    """Grafana variables as Grafana would expand them for 'all nodes' and a 1 s scrape interval."""
    return expr.replace("$__rate_interval", "1m").replace('"$node"', '".*"')


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, tiny_checkpoint):
    if shutil.which("prometheus") is None:
        pytest.skip("the prometheus binary (Debian package `prometheus`) is not installed; CI installs it")
    tmp = tmp_path_factory.mktemp("dashboards")
    ckpt = tiny_checkpoint("qwen3_moe", max_position_embeddings=1024)
    gpu = tmp / "gpu.json"
    gpu.write_text(json.dumps({"name": "Simulated GPU", "total_bytes": 24 * fleet.GB, "foreign_bytes": 3 * fleet.GB}))
    nodes = {"gpu-pc": {"FREETOKEN_AGENT_SIMULATED_GPU": str(gpu)}, "cpu-pc": {}}
    agents, engines, targets = [], [], []
    prom = None
    try:
        for i, (node, extra) in enumerate(nodes.items()):
            models = tmp / f"{node}.yaml"
            models.write_text(json.dumps({"models": [{
                "key": "default.tiny", "namespace": "default", "model": "tiny", "port": 20000,
                "source": {"path": str(ckpt)}, "format": "safetensors",
                "engine": {"device": "cpu", "dtype": "float32", "expertCacheShare": 0.9}}]}))
            if extra:   # a node calibrated earlier: PCIe and CPU-expert bandwidths from its cache
                CalibrationCache(str(tmp / f"state-{node}")).save(HostConfig.detect(node, ()), {
                    "pcie_gbps": 25.0, "cpu_expert_gbps": 6.0, "fill_fraction": 0.8, "device": "cpu",
                    "concurrent": {"pcie_gbps": 22.0, "cpu_expert_gbps": 5.0}})
            metrics_port, offset = fleet.free_port(), fleet.free_port() - 20000
            agents.append(fleet.start_agent(tmp, node, metrics_port=metrics_port, port_offset=offset,
                                            standalone=models, env=fleet.agent_env(**extra)))
            engines.append(f"http://127.0.0.1:{20000 + offset}")
            targets.append(f"127.0.0.1:{metrics_port}")
        rules = tmp / "rules.yaml"
        rules.write_text(yaml.safe_dump(prometheus_rule_spec()))
        prom = fleet.Prometheus(tmp, targets, rule_files=[rules])
        for url in engines:
            fleet.wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 120,
                             f"engine {url} healthy")

        def chat_round() -> None:
            for url in engines:
                r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                    "model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]})
                assert r.status_code == 200, r.text
        # Histogram series appear with the first request; a rate needs Prometheus to have seen
        # them before a later request, so: one round, a scrape of both nodes, another round.
        chat_round()
        fleet.wait_until(lambda: len(prom.query("freetoken_time_to_first_token_seconds_count")) == 2,
                         30, "Prometheus to scrape both engines' histograms")
        chat_round()
        fleet.wait_until(lambda: len(prom.query(
            "increase(freetoken_time_to_first_token_seconds_count[1m]) > 0")) == 2, 30,
            "Prometheus to see requests on both nodes")
        yield prom
    finally:
        for a in agents:
            fleet.stop(a)
        if prom is not None:
            prom.close()


def test_both_nodes_are_in_the_node_variable(prometheus):
    nodes = {r["metric"]["node"] for r in prometheus.query("count by (node) (freetoken_agent_info)")}
    assert nodes == {"gpu-pc", "cpu-pc"}


@pytest.mark.parametrize("dashboard,title,expr", panel_queries(),
                         ids=[f"{d}:{t}:{i}" for i, (d, t, _) in enumerate(panel_queries())])
def test_dashboard_query_returns_data(prometheus, dashboard, title, expr):
    result = prometheus.query(concrete(expr))
    if not result and any(h in expr for h in HARDWARE_DEPENDENT):
        pytest.skip(f"{title}: needs hardware this machine lacks ({expr})")
    assert result, f"{dashboard} / {title}: no data for {expr}"
    values = [float(r["value"][1]) for r in result]
    assert any(math.isfinite(v) for v in values), f"{dashboard} / {title}: only NaN/Inf for {expr}"


def test_alert_rules_evaluate_without_errors(prometheus):
    fleet.wait_until(lambda: all(r["health"] != "unknown" for r in prometheus.rules()), 20,
                     "every alert rule to be evaluated once")
    rules = prometheus.rules()
    assert sorted(r["name"] for r in rules) == ["FreeTokenCPUContention", "FreeTokenEngineDown", "FreeTokenHighTTFT",
                                                "FreeTokenLowExpertHitRate", "FreeTokenMemoryPressure",
                                                "FreeTokenNodeLost"]
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    # a healthy fleet raises nothing but (possibly) the low hit rate of a tiny random model
    firing = {r["name"] for r in rules if r["state"] != "inactive"}
    assert firing <= {"FreeTokenLowExpertHitRate"}, firing
