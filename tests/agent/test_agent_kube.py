"""FreeTokenNode reporting against kmock over real HTTP (the official client, unmodified)."""

import asyncio
import base64
import json
import sys

import pytest

from freetoken_agent.agent import Agent
from freetoken_agent.config import AgentConfig
from freetoken_agent.kube import KubeError, NodeReporter

NODES = "freetoken.io/v1alpha1/freetokennodes"


def _status(kube, name):
    try:
        return dict(kube.objects[NODES, None, name].get("status") or {})
    except KeyError:
        return {}


async def test_creates_missing_node_then_patches_status(kube):
    rep = NodeReporter("gpu-1", str(kube.url))
    await rep.ensure_node()
    assert kube.objects[NODES, None, "gpu-1"]["spec"] == {"models": []}
    await rep.patch_status({"heartbeat": "2026-11-29T12:00:00Z", "memoryPressure": False})
    await rep.patch_status({"memoryPressure": True})
    status = kube.objects[NODES, None, "gpu-1"]["status"]
    assert status == {"heartbeat": "2026-11-29T12:00:00Z", "memoryPressure": True}  # merged


async def test_existing_node_keeps_operator_spec(kube):
    spec = {"models": [{"model": "m", "port": 1919}]}
    kube.objects[NODES, None, "gpu-2"] = {
        "apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenNode",
        "metadata": {"name": "gpu-2", "uid": "u2", "resourceVersion": "7"}, "spec": spec}
    rep = NodeReporter("gpu-2", str(kube.url))
    await rep.ensure_node()
    assert await rep.read_spec() == spec


async def test_reads_api_key_secret(kube):
    kube.objects["v1/secrets", "team", "keys"] = {
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "keys", "namespace": "team", "uid": "s1", "resourceVersion": "1"},
        "data": {"api": base64.b64encode(b"sk-123").decode()}}
    rep = NodeReporter("gpu-3", str(kube.url))
    assert await rep.read_secret("team", "keys", "api") == "sk-123"
    with pytest.raises(KubeError):
        await rep.read_secret("team", "keys", "missing")


async def test_unreachable_api_server_is_a_kube_error():
    rep = NodeReporter("gpu-4", "http://127.0.0.1:9")
    with pytest.raises(KubeError):
        await rep.get_node()


async def test_agent_heartbeat_reports_node_facts(kube, tmp_path):
    """A whole agent in cluster mode (no models yet): the status the operator reads."""
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"name": "Simulated RTX", "total_bytes": 16 << 30,
                               "foreign_bytes": 3 << 30}))
    (tmp_path / "state").mkdir()
    cfg = AgentConfig(node_name="gpu-5", kube_server=str(kube.url), state_dir=str(tmp_path / "state"),
                      simulated_gpu=str(gpu), heartbeat_seconds=0.2, calibrate_on_start=False)
    agent = Agent(cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop, serve_metrics=False))
    beats = []
    for _ in range(100):
        await asyncio.sleep(0.05)
        st = _status(kube, "gpu-5")
        if st and st.get("heartbeat") and st["heartbeat"] not in beats:
            beats.append(st["heartbeat"])
        if len(beats) >= 2:
            break
    stop.set()
    await task
    status = kube.objects[NODES, None, "gpu-5"]["status"]
    assert status["mode"] == "cpu"  # a simulated device is not a GPU to run engines on
    assert status["gpu"]["name"] == "Simulated RTX"
    assert status["gpu"]["vramTotalBytes"] == 16 << 30
    assert status["gpu"]["vramForeignBytes"] == 3 << 30
    assert status["cpuCores"] >= 1 and 0 < status["ramAvailableBytes"] <= status["ramTotalBytes"]
    assert status["memoryPressure"] is False and status["replicas"] == []
    types = {c["type"]: c["status"] for c in status["conditions"]}
    assert types == {"MemoryPressure": "False", "AssignmentsValid": "True"}
    assert status["heartbeat"].endswith("Z")


async def test_invalid_spec_reported_as_condition(kube, tmp_path):
    kube.objects[NODES, None, "gpu-6"] = {
        "apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenNode",
        "metadata": {"name": "gpu-6", "uid": "u6", "resourceVersion": "1"},
        "spec": {"models": [{"model": "m", "port": "not-a-port"}]}}
    cfg = AgentConfig(node_name="gpu-6", kube_server=str(kube.url), state_dir=str(tmp_path),
                      heartbeat_seconds=0.2, calibrate_on_start=False)
    agent = Agent(cfg)
    await agent.reconcile()
    await agent.report()
    cond = {c["type"]: c for c in kube.objects[NODES, None, "gpu-6"]["status"]["conditions"]}
    assert cond["AssignmentsValid"]["status"] == "False" and "port" in cond["AssignmentsValid"]["message"]
    assert agent.replicas == {}  # nothing started from a spec it cannot read


def _node_with_a_keyed_model(name: str) -> dict:
    """A FreeTokenNode whose spec (as the operator writes it) runs model team/m with the key in
    the Secret team/m-api-key."""
    return {"apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenNode",
            "metadata": {"name": name, "uid": f"u-{name}", "resourceVersion": "1"},
            "spec": {"models": [{"key": "team.m", "namespace": "team", "model": "m", "source": {"default": True},
                                 "format": "default", "port": 1919, "engine": {"device": "cpu"},
                                 "apiKeySecret": {"name": "m-api-key", "key": "api-key"}}]}}


async def test_a_missing_api_key_secret_is_reported_and_the_replica_starts_once_it_exists(kube, tmp_path):
    """The operator generates a model's key Secret; until the agent can read it the replica is
    reported failed with the reason (it was silently absent), and it starts, with that key, on
    the first pass after the Secret appears."""
    kube.objects[NODES, None, "gpu-7"] = _node_with_a_keyed_model("gpu-7")
    idle = [sys.executable, "-c", "import time; time.sleep(60)"]    # an engine that never gets ready
    cfg = AgentConfig(node_name="gpu-7", kube_server=str(kube.url), state_dir=str(tmp_path),
                      heartbeat_seconds=0.2, calibrate_on_start=False, engine_command=tuple(idle))
    agent = Agent(cfg)
    await agent.reconcile()
    await agent.report()
    (rep,) = kube.objects[NODES, None, "gpu-7"]["status"]["replicas"]
    assert rep["key"] == "team.m" and rep["state"] == "failed"
    assert "API key" in rep["message"] and "m-api-key" in rep["message"]
    assert agent.replicas == {}

    kube.objects["v1/secrets", "team", "m-api-key"] = {
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "m-api-key", "namespace": "team", "uid": "s7", "resourceVersion": "1"},
        "data": {"api-key": base64.b64encode(b"generated-key").decode()}}
    await agent.reconcile()
    try:
        assert agent.replicas["team.m"].api_key == "generated-key" and agent.key_errors == {}
        await agent.report()
        (rep,) = kube.objects[NODES, None, "gpu-7"]["status"]["replicas"]
        assert rep["state"] != "failed"
    finally:
        await agent.replicas["team.m"].stop()


async def test_an_api_server_away_is_one_warning_a_minute_not_one_a_pass(tmp_path, caplog):
    """The spec is read every 2 s and the status written every heartbeat: with the API server
    down that was a warning each time (plus the client's retry lines). Now one when it goes,
    a reminder a minute, and one line when it answers again."""
    import logging

    from freetoken_agent import agent as agent_mod
    cfg = AgentConfig(node_name="gpu-8", kube_server="http://127.0.0.1:9", state_dir=str(tmp_path),
                      heartbeat_seconds=0.2, calibrate_on_start=False)
    agent = Agent(cfg)
    with caplog.at_level(logging.INFO, logger="freetoken_agent.agent"):
        for _ in range(5):
            await agent.report()
            assert await agent.desired() is None           # keep what runs
        ours = [r for r in caplog.records if r.name == "freetoken_agent.agent"]
        assert len([r for r in ours if r.levelno == logging.WARNING]) == 1
        agent._kube_warned -= agent_mod.KUBE_WARN_EVERY     # a minute later
        await agent.report()
        warned = [r.getMessage() for r in caplog.records
                  if r.name == "freetoken_agent.agent" and r.levelno == logging.WARNING]
        assert len(warned) == 2 and "still, 11 failures" in warned[1]
        agent._kube_ok()
        assert "answers again" in caplog.records[-1].getMessage()


async def test_a_secret_the_agent_may_not_read_names_the_chart_value_to_change(kube, tmp_path):
    kube.objects[NODES, None, "gpu-9"] = _node_with_a_keyed_model("gpu-9")
    agent = Agent(AgentConfig(node_name="gpu-9", kube_server=str(kube.url), state_dir=str(tmp_path),
                              heartbeat_seconds=0.2, calibrate_on_start=False))

    async def forbidden(namespace, name, key):   # what the API server answers outside the Roles
        raise KubeError("read_namespaced_secret: 403 Forbidden", 403)
    agent.reporter.read_secret = forbidden
    await agent.reconcile()
    await agent.report()
    (rep,) = kube.objects[NODES, None, "gpu-9"]["status"]["replicas"]
    assert rep["state"] == "failed" and "agent.secretNamespaces must list 'team'" in rep["message"]
