"""The real Prometheus server (Debian package ``prometheus``) scrapes a live engine on loopback,
and the engine queries the chart's dashboards and alerts use return data."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

import httpx
import pytest

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus (Debian package) not installed")

QUERIES = [
    "sum by (node, model) (rate(freetoken_generation_tokens_total[30s]))",
    "histogram_quantile(0.95, sum by (le, model) (rate(freetoken_time_to_first_token_seconds_bucket[30s])))",
    "sum by (model) (freetoken_requests_running)",
    "sum by (model) (freetoken_requests_queued)",
    "freetoken_expert_fill_fraction",
    "freetoken_expert_cache_capacity_experts",
    "sum by (node, model) (freetoken_expert_cache_hits_total + freetoken_expert_cache_misses_total)",
    'sum by (endpoint, status) (freetoken_http_requests_total{endpoint="chat"})',
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_scrapes_the_engine_and_dashboard_queries_return_data(live, tmp_path):
    port = free_port()
    target = live.url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n- job_name: engine\n  static_configs:\n"
        f"  - targets: ['{target}']\n    labels: {{node: n1, model: tiny}}\n")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = live.openai()
    api = f"http://127.0.0.1:{port}/api/v1/query"
    try:
        pending, deadline = list(QUERIES), time.monotonic() + 40
        while pending and time.monotonic() < deadline:
            client.chat.completions.create(model=live.model, max_tokens=4,
                                           messages=[{"role": "user", "content": "hi"}])
            time.sleep(0.5)
            still = []
            for q in pending:
                try:
                    r = httpx.get(api, params={"query": q}, timeout=5).json()
                except (httpx.HTTPError, ValueError):
                    still.append(q)
                    continue
                assert r["status"] == "success", (q, r)
                if not r["data"]["result"]:
                    still.append(q)
            pending = still
        assert not pending, f"no data for: {pending}"
        up = httpx.get(api, params={"query": "up"}).json()["data"]["result"]
        assert [s["value"][1] for s in up] == ["1"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
