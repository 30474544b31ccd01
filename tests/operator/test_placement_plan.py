"""Table-driven tests of the pure planner: fit, bandwidth, stickiness, node loss, pressure, spread."""

from __future__ import annotations

import pytest

from freetoken_operator.observe import ModelView, NodeView, ReplicaView, Toleration
from freetoken_operator.plan import plan

GI = 2**30


def gpu(name, vram=24, foreign=0, pcie=25.0, age=1.0, pressure=False, labels=(), taints=(), replicas=None, cpu_gbps=20.0,
        stored=frozenset()):
    return NodeView(name=name, heartbeat_age_s=age, mode="gpu", vram_total_bytes=vram * GI,
                    vram_foreign_bytes=foreign * GI, ram_total_bytes=128 * GI, pcie_gbps=pcie,
                    cpu_expert_gbps=cpu_gbps, memory_pressure=pressure, labels=tuple(labels),
                    taints=tuple(taints), replicas=replicas or {}, stored_sha256=stored)


def cpu(name, ram=32, age=1.0):
    return NodeView(name=name, heartbeat_age_s=age, mode="cpu", ram_total_bytes=ram * GI, pcie_gbps=None,
                    cpu_expert_gbps=10.0)


def m(name, replicas=1, need=0, **kw):
    return ModelView(namespace="default", name=name, replicas=replicas, need_bytes=need * GI, **kw)


def nodes_of(result, key):
    return [p.node for p in result.placements[f"default.{key}"]]


CASES = [
    # id, models, nodes, previous, expected {model: nodes}, unsatisfied models
    ("fit: model goes where it fits",
     [m("big", need=20)], [gpu("small", vram=16, pcie=50), gpu("large", vram=24)], {},
     {"big": ["large"]}, set()),
    ("fit: foreign VRAM use (a game) counts against capacity",
     [m("big", need=20)], [gpu("a", vram=24, foreign=8, pcie=50), gpu("b", vram=24)], {},
     {"big": ["b"]}, set()),
    ("fit: two models share a node only while the sum fits",
     [m("x", need=12), m("y", need=12)], [gpu("a", vram=20)], {},
     {"x": ["a"], "y": []}, {"y"}),
    ("bandwidth: the faster PCIe link wins among equals",
     [m("x")], [gpu("slow", pcie=12), gpu("fast", pcie=50), gpu("mid", pcie=25)], {},
     {"x": ["fast"]}, set()),
    ("bandwidth: minimum PCIe excludes slow nodes and cpu nodes",
     [m("x", min_pcie_gbps=20.0)], [gpu("slow", pcie=12), cpu("c")], {},
     {"x": []}, {"x"}),
    ("locality: a node that already ran the model beats a faster one",
     [m("x")], [gpu("fast", pcie=50), gpu("had", pcie=12, replicas={"default.x": ReplicaView("stopped")})], {},
     {"x": ["had"]}, set()),
    ("locality: a node whose agent stored the model's url file (by sha256) beats a faster one",
     [m("x", sha256="ab" * 32)], [gpu("fast", pcie=50), gpu("stored", pcie=12, stored=frozenset({"ab" * 32}))], {},
     {"x": ["stored"]}, set()),
    ("locality: another file stored there does not count",
     [m("x", sha256="ab" * 32)], [gpu("fast", pcie=50), gpu("other", pcie=12, stored=frozenset({"cd" * 32}))], {},
     {"x": ["fast"]}, set()),
    ("stability: a healthy replica stays although a faster node appeared",
     [m("x")], [gpu("old", pcie=10), gpu("new", pcie=60)], {"default.x": {"old": 1919}},
     {"x": ["old"]}, set()),
    ("node loss: a stale node loses its replica to a healthy one",
     [m("x")], [gpu("dead", age=31.0), gpu("alive")], {"default.x": {"dead": 1919}},
     {"x": ["alive"]}, set()),
    ("node loss: a node that never reported is not used",
     [m("x")], [gpu("new", age=None)], {},
     {"x": []}, {"x"}),
    ("pressure: one replica leaves a pressured node when another node can take it",
     [m("x", need=4), m("y", need=4, priority=1)], [gpu("hot", pressure=True), gpu("cool")],
     {"default.x": {"hot": 1919}, "default.y": {"hot": 1920}},
     {"x": ["cool"], "y": ["hot"]}, set()),
    ("pressure: nothing more leaves while the node still runs the replica that left",
     [m("x", need=4), m("y", need=4, priority=1)],
     [gpu("hot", pressure=True, replicas={"default.x": ReplicaView("ready"), "default.y": ReplicaView("ready")}),
      gpu("cool")],
     {"default.y": {"hot": 1920}},
     {"x": ["cool"], "y": ["hot"]}, set()),
    ("pressure: with nowhere to go the replica stays",
     [m("x", need=4)], [gpu("hot", pressure=True)], {"default.x": {"hot": 1919}},
     {"x": ["hot"]}, set()),
    ("spread: replicas of two models go to different nodes",
     [m("x"), m("y")], [gpu("a", pcie=50), gpu("b", pcie=25)], {},
     {"x": ["a"], "y": ["b"]}, set()),
    ("binpack: the second model fills the node with the least free memory",
     [m("x", need=4, strategy="Binpack"), m("y", need=4, strategy="Binpack")],
     [gpu("a", vram=24, pcie=50), gpu("b", vram=24, pcie=25)], {},
     {"x": ["a"], "y": ["a"]}, set()),
    ("replicas: one per node, short when there are too few nodes",
     [m("x", replicas=3)], [gpu("a"), gpu("b")], {},
     {"x": ["a", "b"]}, {"x"}),
    ("scale down keeps ready replicas",
     [m("x", replicas=1)],
     [gpu("a"), gpu("b", replicas={"default.x": ReplicaView("ready", "http://b:1919")})],
     {"default.x": {"a": 1919, "b": 1919}}, {"x": ["b"]}, set()),
    ("selector and taints",
     [m("x", node_selector=(("gpu", "4090"),)), m("y", tolerations=(Toleration("gaming", "Exists"),))],
     [gpu("a", labels=(("gpu", "4090"),), taints=((("effect", "NoSchedule"), ("key", "gaming")),)),
      gpu("b")], {},
     {"x": [], "y": ["a"]}, {"x"}),
    ("device: gpu-only models skip cpu nodes, any runs on cpu",
     [m("g", device="gpu"), m("c", device="any")], [cpu("c1")], {},
     {"g": [], "c": ["c1"]}, {"g"}),
    ("priority: the higher-priority model gets the only slot",
     [m("low", need=20), m("high", need=20, priority=5)], [gpu("a")], {},
     {"high": ["a"], "low": []}, {"low"}),
    ("a source the agents cannot load is never placed",
     [m("u", unsupported="source.pvc is not supported by the node agents yet")], [gpu("a")], {},
     {"u": []}, {"u"}),
    ("deleted models leave their nodes",
     [m("x", deleting=True)], [gpu("a")], {"default.x": {"a": 1919}},
     {}, set()),
]


@pytest.mark.parametrize("models,nodes,previous,expected,short", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan_table(models, nodes, previous, expected, short):
    result = plan(models, nodes, previous, stale_seconds=30.0)
    assert {k.split(".", 1)[1]: [p.node for p in v] for k, v in result.placements.items()} == expected
    assert {k.split(".", 1)[1] for k in result.unsatisfied} == short


def test_ports_are_allocated_per_node_and_kept():
    nodes = [gpu("a")]
    first = plan([m("x"), m("y")], nodes, {})
    ports = {k: v[0].port for k, v in first.placements.items()}
    assert ports == {"default.x": 1919, "default.y": 1920}
    again = plan([m("y")], nodes, {"default.y": {"a": 1920}})
    assert again.placements["default.y"][0].port == 1920   # no renumbering of a running replica


def test_explicit_port_conflict_is_reported():
    result = plan([m("x", port=8000), m("y", port=8000)], [gpu("a")], {})
    assert nodes_of(result, "x") == ["a"] and nodes_of(result, "y") == []
    assert "port 8000 in use" in result.unsatisfied["default.y"]


def test_unsatisfied_reason_names_the_causes():
    result = plan([m("big", need=40)], [gpu("a", vram=24), gpu("b", age=99.0)], {})
    why = result.unsatisfied["default.big"]
    assert "0/1 replicas placed" in why
    assert "1 insufficient memory" in why and "1 heartbeat stale" in why


def test_decisions_explain_moves():
    result = plan([m("x")], [gpu("dead", age=45.0), gpu("alive", pcie=30)], {"default.x": {"dead": 1919}})
    actions = [(d.action, d.node) for d in result.decisions]
    assert actions == [("remove", "dead"), ("place", "alive")]
    assert "heartbeat stale" in result.decisions[0].reason


def test_plan_is_deterministic_and_pure():
    models = [m("x", replicas=2), m("y", need=3)]
    nodes = [gpu("a", pcie=20), gpu("b", pcie=20), gpu("c", pcie=20)]
    assert plan(models, nodes, {}) == plan(list(reversed(models)), list(reversed(nodes)), {})


def test_a_replica_moved_off_a_pressured_node_keeps_its_target():
    # hot is pressed; "low" must move to the one free node although "big" (higher priority,
    # not yet placed) would fit there too: the move reserves the room first
    nodes = [gpu("hot", vram=24, pressure=True), gpu("spare", vram=24)]
    models = [m("low", need=10), m("big", need=20, priority=9)]
    result = plan(models, nodes, {"default.low": {"hot": 1919}})
    assert nodes_of(result, "low") == ["spare"]
    assert nodes_of(result, "big") == [] and "default.big" in result.unsatisfied
    assert [(d.action, d.node) for d in result.decisions if d.model == "default.low"] == [
        ("remove", "hot"), ("place", "spare")]
