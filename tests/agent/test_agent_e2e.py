"""End to end on loopback: `freetoken-agent run` (subprocess) supervising a real `freetoken serve`
on a tiny checkpoint, a simulated GPU whose foreign use the test changes mid-stream, and the
real Prometheus server scraping the agent.

What a node owner and a fleet operator care about, in order:
1. foreign memory use appears while a stream is decoding -> the engine's expert cache shrinks
   (checked on the engine's own /admin/cache) before the stream ends;
2. the stream completes with exactly the tokens of an undisturbed run (greedy);
3. after the cool-down the cache grows back to its size before;
4. a killed engine is restarted;
5. Prometheus scrapes the agent: its own metrics and the engine's, labelled by node and model.
"""

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from procs import engine_pids

from freetoken_agent.calibration import CalibrationCache, HostConfig

pytestmark = pytest.mark.slow
TOKEN = "e2e-admin"
NODE = "e2e-node"
GB = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_gpu(path: Path, foreign: int, total: int = 64 * GB) -> None:
    path.write_text(json.dumps({"name": "Simulated GPU", "total_bytes": total, "foreign_bytes": foreign}))
    t = time.time_ns()
    os.utime(path, ns=(t, t))


def engine_pid(port: int) -> int | None:
    """The pid of the `freetoken serve` listening on ``port``."""
    pids = engine_pids(port)
    return pids[0] if pids else None


async def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


async def stream_text(client: httpx.AsyncClient, on_first=None) -> tuple[str, int, float]:
    """Greedy completion streamed over SSE: (text, completion tokens, monotonic end time)."""
    body = {"model": "tiny", "prompt": [5, 17, 42, 99, 7], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    parts, tokens, first = [], None, True
    async with client.stream("POST", "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                parts.append(choice["text"])
                if first and choice["text"] and on_first is not None:
                    first = False
                    on_first()
    return "".join(parts), tokens, time.monotonic()


async def metric(url: str, name: str, **labels) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families
    async with httpx.AsyncClient() as c:
        text = (await c.get(url, timeout=5)).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


@pytest.fixture
def prometheus(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the Debian package `prometheus` is not installed (CI installs it)")
    port = free_port()
    procs = []

    def start(target: str) -> str:
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                       "scrape_configs:\n- job_name: freetoken-agent\n"
                       f"  static_configs: [{{targets: ['{target}']}}]\n")
        procs.append(subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return f"http://127.0.0.1:{port}"

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


async def prom_query(base: str, query: str) -> list:
    async with httpx.AsyncClient() as c:
        try:
            r = await c.get(f"{base}/api/v1/query", params={"query": query}, timeout=5)
        except httpx.HTTPError:
            return []
    return r.json()["data"]["result"] if r.status_code == 200 else []


async def test_pressure_mid_stream_restart_and_prometheus(tmp_path, tiny_checkpoint, prometheus):
    ckpt = tiny_checkpoint("qwen3_moe", max_position_embeddings=1024)
    state, gpu, models = tmp_path / "state", tmp_path / "gpu.json", tmp_path / "models.yaml"
    write_gpu(gpu, foreign=0)
    port, offset, metrics_port = 20000, free_port() - 20000, free_port()
    engine_url, agent_metrics = f"http://127.0.0.1:{port + offset}", f"http://127.0.0.1:{metrics_port}/metrics"
    models.write_text(f"models:\n- model: tiny\n  port: {port}\n  source: {{path: {ckpt}}}\n"
                      "  format: safetensors\n  engine: {device: cpu, expertCacheShare: 0.9}\n")
    # The node was calibrated before: the agent must use its cache and push q* to the engine.
    CalibrationCache(str(state)).save(HostConfig.detect(NODE, ()), {
        "pcie_gbps": None, "cpu_expert_gbps": 5.0, "fill_fraction": 0.75, "device": "cpu",
        "concurrent": {"pcie_gbps": None, "cpu_expert_gbps": 4.0}})
    env = {**os.environ, "FREETOKEN_AGENT_SIMULATED_GPU": str(gpu), "FREETOKEN_AGENT_ADMIN_TOKEN": TOKEN,
           "FREETOKEN_AGENT_HEADROOM_BYTES": str(GB), "FREETOKEN_AGENT_HEADROOM_FRACTION": "0",
           "FREETOKEN_AGENT_HYSTERESIS_BYTES": "0", "FREETOKEN_AGENT_COOLDOWN_SECONDS": "2",
           "FREETOKEN_AGENT_GROW_INTERVAL_SECONDS": "0.3", "FREETOKEN_AGENT_GROW_STEP_FRACTION": "0.5",
           "FREETOKEN_AGENT_TICK_SECONDS": "0.1", "FREETOKEN_AGENT_HEALTH_INTERVAL_SECONDS": "0.3",
           "FREETOKEN_AGENT_BACKOFF_MAX_SECONDS": "1", "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(
        [sys.executable, "-m", "freetoken_agent.cli", "run", "--node-name", NODE, "--standalone", str(models),
         "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port),
         "--engine-port-offset", str(offset), "--state-dir", str(state)],
        env=env, stdout=open(tmp_path / "agent.log", "wb"), stderr=subprocess.STDOUT)
    prom = prometheus(f"127.0.0.1:{metrics_port}")
    admin = httpx.AsyncClient(base_url=engine_url, headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        async def ready():
            try:
                return (await admin.get("/health")).status_code == 200
            except httpx.HTTPError:
                return False
        await wait_for(ready, 300, "the engine to become healthy")   # 120 s flaked once under a loaded CI

        async def cache():
            return (await admin.get("/admin/cache")).json()["expert_cache"]
        ec = await cache()
        full = ec["max_experts"] * ec["expert_bytes"]
        await wait_for(lambda: _eq(cache, "capacity_bytes", full), 10, "the cache to fill up")
        assert ec["fill_fraction"] == pytest.approx(0.75) or (await cache())["fill_fraction"] == pytest.approx(0.75)

        undisturbed, n_tokens, _ = await stream_text(admin)
        assert n_tokens == 400

        # Foreign use that leaves room for half the experts above the 1 GiB headroom.
        half = max(ec["min_experts"], ec["max_experts"] // 2)
        foreign = 64 * GB - GB - half * ec["expert_bytes"]
        sizes: list[tuple[float, int]] = []

        async def watch():
            while True:
                sizes.append((time.monotonic(), (await cache())["capacity_bytes"]))
                await asyncio.sleep(0.02)
        watcher = asyncio.create_task(watch())
        disturbed, n2, ended = await stream_text(admin, on_first=lambda: write_gpu(gpu, foreign))
        watcher.cancel()
        shrunk_at = [t for t, b in sizes if b <= half * ec["expert_bytes"]]
        assert shrunk_at and shrunk_at[0] < ended, "the cache must shrink while the stream decodes"
        after = [b for t, b in sizes if t >= shrunk_at[0]]
        assert max(after) <= half * ec["expert_bytes"], "no regrowth while the foreign use stays"
        assert (disturbed, n2) == (undisturbed, n_tokens), "pressure must not change a greedy stream"
        assert (await cache())["capacity_bytes"] <= half * ec["expert_bytes"]
        assert await metric(agent_metrics, "freetoken_agent_pressure_events_total", action="shrink") >= 1
        reaction = await metric(agent_metrics, "freetoken_agent_pressure_reaction_seconds_sum")
        assert 0 < reaction < 5

        write_gpu(gpu, foreign=0)  # the game quits
        await wait_for(lambda: _eq(cache, "capacity_bytes", full), 15, "the cache to grow back")

        old = engine_pid(port + offset)
        assert old is not None
        os.kill(old, signal.SIGKILL)  # a crash
        await wait_for(lambda: metric(agent_metrics, "freetoken_agent_engine_restarts_total",
                                      model="default.tiny"), 10, "the restart to be counted")
        await wait_for(ready, 300, "the restarted engine to become healthy")
        assert engine_pid(port + offset) not in (None, old)
        await wait_for(lambda: metric(agent_metrics, "freetoken_agent_replica_state", state="ready"),
                       10, "the agent to mark the restarted engine ready")
        agent.send_signal(signal.SIGUSR1)  # "re-measure now": through the running engine

        # Prometheus saw the agent's metrics and the engine's own, relabelled by node and model.
        for q in ['freetoken_agent_expert_cache_bytes{model="default.tiny"}',
                  'freetoken_agent_engine_restarts_total{model="default.tiny"} >= 1',
                  f'freetoken_agent_pressure_events_total{{action="shrink",node="{NODE}"}} >= 1',
                  f'freetoken_expert_cache_capacity_bytes{{node="{NODE}",model="default.tiny"}}']:
            await wait_for(lambda: prom_query(prom, q), 30, f"Prometheus to answer {q}", interval=0.5)
        await wait_for(lambda: metric(agent_metrics, "freetoken_agent_calibrations_total", source="engine"),
                       90, "the re-measurement asked for with SIGUSR1", interval=0.5)
        assert (await cache())["fill_fraction"] == pytest.approx(1.0)  # measured q* on CPU, pushed
    finally:
        await admin.aclose()
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
    assert agent.returncode == 0, (tmp_path / "agent.log").read_text()[-3000:]
    assert engine_pid(port + offset) is None, "stopping the agent stops its engines"


async def _eq(fn, key, value):
    return (await fn())[key] == value


async def test_cluster_mode_assign_then_unassign(kube, tmp_path, tiny_checkpoint):
    """The operator writes spec.models: the agent starts the engine and reports it ready with
    its endpoint; the operator removes it: the engine stops and the status says so."""
    from freetoken_agent.agent import Agent
    from freetoken_agent.config import AgentConfig

    nodes = "freetoken.io/v1alpha1/freetokennodes"
    ckpt = tiny_checkpoint("qwen3_moe")
    port = 21000
    offset = free_port() - port
    spec = {"models": [{"key": "team.tiny", "namespace": "team", "model": "tiny", "port": port,
                        "source": {"path": str(ckpt)}, "format": "safetensors",
                        "engine": {"device": "cpu"}}]}
    kube.objects[nodes, None, "k-node"] = {
        "apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenNode",
        "metadata": {"name": "k-node", "uid": "u1", "resourceVersion": "1"}, "spec": spec}
    cfg = AgentConfig(node_name="k-node", kube_server=str(kube.url), state_dir=str(tmp_path),
                      engine_port_offset=offset, heartbeat_seconds=0.3, calibrate_on_start=False,
                      health_interval=0.3)
    agent = Agent(cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop, serve_metrics=False))

    async def replicas():
        return dict(kube.objects[nodes, None, "k-node"].get("status") or {}).get("replicas") or []
    try:
        await wait_for(lambda: _ready(replicas), 120, "the replica to be reported ready", interval=0.2)
        [r] = await replicas()
        assert r["endpoint"] == f"http://127.0.0.1:{port + offset}" and r["restarts"] == 0
        assert r["expertCacheBytes"] > 0
        async with httpx.AsyncClient() as c:
            assert (await c.get(r["endpoint"] + "/health")).json()["model"] == "tiny"
        await asyncio.to_thread(_operator_patch, str(kube.url), "k-node", {"spec": {"models": []}})
        await wait_for(lambda: _gone(replicas), 30, "the replica to leave the status", interval=0.2)
        assert engine_pid(port + offset) is None
    finally:
        stop.set()
        await task


def _operator_patch(server: str, name: str, body: dict) -> None:
    """What the operator does when it moves the model away: merge-patch the node's spec."""
    from kubernetes import client
    cfg = client.Configuration()
    cfg.host = server
    with client.ApiClient(cfg) as api:
        client.CustomObjectsApi(api).patch_cluster_custom_object(
            "freetoken.io", "v1alpha1", "freetokennodes", name, body,
            _content_type="application/merge-patch+json")


async def _ready(replicas):
    rs = await replicas()
    return bool(rs) and rs[0]["state"] == "ready"


async def _gone(replicas):
    return await replicas() == []


async def test_cluster_mode_fetches_a_url_source_and_reports_a_bad_one(kube, tmp_path, tiny_checkpoint):
    """source.url: the agent downloads the tar of a checkpoint over HTTP into its model store,
    checks its sha256 and serves it; a URL that answers 404 leaves that replica failed, with the
    HTTP status and the URL without its query in the node's status."""
    import hashlib
    import tarfile

    from http_files import FileServer

    from freetoken_agent.agent import Agent
    from freetoken_agent.config import AgentConfig

    ckpt = tiny_checkpoint("qwen3_moe")
    archive = tmp_path / "tiny.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(ckpt, arcname="tiny")
    data = archive.read_bytes()
    server = FileServer()
    server.files["/tiny.tar.gz"] = data
    nodes, port = "freetoken.io/v1alpha1/freetokennodes", 21100
    offset = free_port() - port
    spec = {"models": [
        {"key": "team.tiny", "namespace": "team", "model": "tiny", "port": port, "format": "safetensors",
         "source": {"url": server.url("/tiny.tar.gz"), "sha256": hashlib.sha256(data).hexdigest()},
         "engine": {"device": "cpu"}},
        {"key": "team.gone", "namespace": "team", "model": "gone", "port": port + 1, "format": "safetensors",
         "source": {"url": server.url("/gone.tar.gz") + "?signature=SECRET"}, "engine": {"device": "cpu"}}]}
    kube.objects[nodes, None, "u-node"] = {
        "apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenNode",
        "metadata": {"name": "u-node", "uid": "u2", "resourceVersion": "1"}, "spec": spec}
    store = tmp_path / "store"
    cfg = AgentConfig(node_name="u-node", kube_server=str(kube.url), state_dir=str(tmp_path / "state"),
                      model_store=str(store), engine_port_offset=offset, heartbeat_seconds=0.3,
                      calibrate_on_start=False, health_interval=0.3)
    stop = asyncio.Event()
    task = asyncio.create_task(Agent(cfg).run(stop, serve_metrics=False))

    async def states():
        reps = dict(kube.objects[nodes, None, "u-node"].get("status") or {}).get("replicas") or []
        return {r["key"]: r for r in reps}

    async def settled():
        s = await states()
        return s if s.get("team.tiny", {}).get("state") == "ready" and s.get("team.gone", {}).get("state") == "failed" else None
    try:
        s = await wait_for(settled, 120, "the url model ready and the 404 one failed", interval=0.2)
        async with httpx.AsyncClient() as c:
            assert (await c.get(s["team.tiny"]["endpoint"] + "/health")).json()["model"] == "tiny"
        assert (store / f"sha256-{hashlib.sha256(data).hexdigest()}" / "model" / "tiny" / "config.json").exists()
        msg = s["team.gone"]["message"]
        assert "HTTP 404" in msg and server.url("/gone.tar.gz") in msg and "SECRET" not in msg
        assert [p for p, _ in server.requests].count("/tiny.tar.gz") == 1
        node_status = kube.objects[nodes, None, "u-node"]["status"]      # what the operator places by
        assert node_status["storedSha256"] == [hashlib.sha256(data).hexdigest()]
    finally:
        stop.set()
        await task
        server.close()
