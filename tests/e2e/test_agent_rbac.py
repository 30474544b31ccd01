"""The chart's agent RBAC allows every request a real ``freetoken-agent run`` makes, and its
Secret access is namespaced: run one agent against kmock, give its node a model whose API key
lives in a Secret, and check each recorded request against the rendered ClusterRole and Roles."""

from __future__ import annotations

import base64

import helm_python as helm
import pytest
import yaml

import fleet
import kmock_cluster as kc
from crdcheck import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def agent_rbac(secret_namespaces: list[str]) -> tuple[list[dict], dict[str, list[dict]]]:
    out = helm.Chart.load(ROOT / "charts" / "freetoken").render(
        {"agent": {"secretNamespaces": secret_namespaces}}, name="ft", namespace="freetoken")
    docs = [d for d in yaml.safe_load_all(out["freetoken/templates/agent-rbac.yaml"]) if d]
    cluster = next(d for d in docs if d["kind"] == "ClusterRole")["rules"]
    roles = {d["metadata"]["namespace"]: d["rules"] for d in docs if d["kind"] == "Role"}
    return cluster, roles


def _allowed(rules: list[dict], verb: str, group: str, resource: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


async def test_agent_requests_are_allowed_by_the_chart(kmock, tmp_path):
    kc.prepare(kmock)
    kmock.objects["v1/secrets", "llm", "key"] = kc.seeded({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "key", "namespace": "llm"},
        "data": {"api-key": base64.b64encode(b"s3cret").decode()}})
    agent = fleet.start_agent(tmp_path, "pc", metrics_port=fleet.free_port(), port_offset=fleet.free_port() - 1919,
                              kube_server=str(kmock.url).rstrip("/"), heartbeat=0.5)
    try:
        async def registered():
            return ((await kc.get(kmock, kc.node_path("pc"))) or {}).get("status", {}).get("heartbeat")
        await kc.wait_for(registered, 30, "the agent's FreeTokenNode")
        await kc.patch(kmock, kc.node_path("pc"), {"spec": {"models": [{
            "key": "llm.m", "namespace": "llm", "model": "m", "source": {"path": str(tmp_path / "missing")},
            "format": "safetensors", "port": 1919, "engine": {"device": "cpu"},
            "apiKeySecret": {"name": "key", "key": "api-key"}}]}})

        def secret_reads():
            return [kmock[i] for i in range(len(kmock)) if "/secrets/" in str(kmock[i].url.path)]
        await kc.wait_for(secret_reads, 30, "the agent to read the model's API key")
    finally:
        await fleet.astop([agent])

    used = kc.rbac_requests(kmock, ("OpenAPI-Generator",))
    assert {("create", "freetoken.io", "freetokennodes"), ("patch", "freetoken.io", "freetokennodes/status"),
            ("get", "", "secrets")} <= used
    cluster, roles = agent_rbac(["llm"])
    denied = {u for u in used if u[2] != "secrets" and not _allowed(cluster, *u)}
    assert denied == set(), f"the chart's agent ClusterRole forbids {sorted(denied)}"
    assert not _allowed(cluster, "get", "", "secrets")   # no cluster-wide Secret access
    assert _allowed(roles["llm"], "get", "", "secrets")
    assert "llm" not in agent_rbac([])[1]   # only listed namespaces (and the release's) get a Role
