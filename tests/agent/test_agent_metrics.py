"""Metrics: every agent name in one module, values read at scrape time, engines relabelled."""

import json

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from freetoken_agent import metrics as m
from freetoken_agent.agent import Agent
from freetoken_agent.config import AgentConfig

ENGINE_TEXT = """# HELP freetoken_requests_total Requests served.
# TYPE freetoken_requests_total counter
freetoken_requests_total{endpoint="chat"} 7.0
# HELP freetoken_expert_cache_hits_total Expert cache hits.
# TYPE freetoken_expert_cache_hits_total counter
freetoken_expert_cache_hits_total 42.0
# HELP python_gc_objects_collected_total Not ours.
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1.0
"""


def _samples(registry):
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


async def test_scrape_reads_live_state(tmp_path):
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"name": "Sim", "total_bytes": 10 << 30, "foreign_bytes": 2 << 30}))
    models = tmp_path / "models.yaml"
    models.write_text("models: []\n")
    agent = Agent(AgentConfig(node_name="n1", standalone=str(models), state_dir=str(tmp_path),
                              simulated_gpu=str(gpu), calibrate_on_start=False))
    agent.calibration = {"pcie_gbps": 48.6, "cpu_expert_gbps": 21.0, "fill_fraction": 0.7,
                         "concurrent": {"pcie_gbps": 45.0, "cpu_expert_gbps": 18.0}}
    await agent.controller.tick()
    s = _samples(agent.metrics.registry)
    assert s["freetoken_agent_memory_total_bytes"] == [({"node": "n1"}, float(10 << 30))]
    assert s["freetoken_agent_memory_foreign_bytes"] == [({"node": "n1"}, float(2 << 30))]
    assert s["freetoken_agent_pcie_bytes_per_second"][0][1] == 48.6e9
    assert s["freetoken_agent_fill_fraction"][0][1] == 0.7
    assert s["freetoken_agent_memory_pressure"][0][1] == 0.0
    # zeros exported before the first event, labelled by node like every agent metric
    assert {(lab["node"], lab["action"], v) for lab, v in s["freetoken_agent_pressure_events_total"]} == {
        ("n1", "shrink", 0.0), ("n1", "grow", 0.0)}
    # collectors read at scrape time: change the world, scrape again, no agent code in between
    gpu.write_text(json.dumps({"name": "Sim", "total_bytes": 10 << 30, "foreign_bytes": 5 << 30}))
    import os
    os.utime(gpu, ns=(10**18, 10**18))
    await agent.controller.tick()
    s = _samples(agent.metrics.registry)
    assert s["freetoken_agent_memory_foreign_bytes"] == [({"node": "n1"}, float(5 << 30))]


def test_every_name_is_declared_in_the_metrics_module(tmp_path):
    """Names follow the project's rules: freetoken_agent_ prefix, unit suffix for byte/time values."""
    for name in m.GAUGES:
        full = m.P + name
        assert full.startswith("freetoken_agent_")
        if "bytes" in name:
            assert name.endswith(("_bytes", "_bytes_per_second")), name


def test_engine_metrics_are_relabelled_with_node_and_model():
    snap = type("S", (), {"node": "n9"})()
    col = m.EngineCollector(lambda: snap, lambda: [("default.a", lambda: ENGINE_TEXT),
                                                  ("default.b", lambda: ENGINE_TEXT),
                                                  ("default.down", _unreachable)])
    fams = {f.name: f for f in col.collect()}
    reqs = fams["freetoken_requests"].samples
    assert {(s.labels["node"], s.labels["model"], s.labels["endpoint"]) for s in reqs} == {
        ("n9", "default.a", "chat"), ("n9", "default.b", "chat")}
    assert "python_gc_objects_collected" not in fams  # only the engines' own freetoken_* names
    up = {s.labels["model"]: s.value for s in fams["freetoken_agent_engine_up"].samples}
    assert up == {"default.a": 1, "default.b": 1, "default.down": 0}


def _unreachable():
    raise ConnectionError("engine down")


def test_a_download_in_progress_is_exported_per_model():
    from freetoken_agent.snapshot import NodeSnapshot, ReplicaSnapshot

    def replica(key, state, fetched=None, size=None):
        return ReplicaSnapshot(key=key, model=key, state=state, endpoint="", restarts=0, message="",
                               expert_cache_bytes=None, expert_cache_floor_bytes=None,
                               expert_cache_max_bytes=None, device="cuda", fetched_bytes=fetched,
                               fetch_size_bytes=size)
    snap = NodeSnapshot(node="n1", mode="gpu", address="127.0.0.1", domain="simulated", gpus=(),
                        total_bytes=1, used_bytes=0, ours_bytes=0, headroom_bytes=0, cpu_cores=2,
                        ram_total_bytes=1, ram_available_bytes=1, psi=None, calibration=None,
                        memory_pressure=False,
                        replicas=(replica("d.big", "starting", 3 << 30, 60 << 30),
                                  replica("d.chunked", "starting", 5 << 20), replica("d.small", "ready")))
    metrics = m.AgentMetrics("n1")
    metrics.attach(lambda: snap, lambda: [])
    s = _samples(metrics.registry)
    assert {(lab["model"], v) for lab, v in s["freetoken_agent_model_fetched_bytes"]} == {
        ("d.big", float(3 << 30)), ("d.chunked", float(5 << 20))}
    assert s["freetoken_agent_model_fetch_size_bytes"] == [({"node": "n1", "model": "d.big"}, float(60 << 30))]
