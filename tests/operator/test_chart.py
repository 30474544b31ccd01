"""The Helm chart, linted and rendered by the Helm v4 library (helm-python-sdk), for default and
non-default values; every rendered object passes kubernetes-validate (strict), RBAC is least
privilege, workloads run as non-root, generated files are up to date."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import tomllib

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from crdcheck import ROOT

CHART = ROOT / "charts" / "freetoken"
K8S_VERSION = "1.33"
PROMETHEUS_OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

NON_DEFAULT = {
    "operator": {"staleSeconds": 12, "apiTimeoutSeconds": 7, "verbose": True, "nodeSelector": {"kubernetes.io/os": "linux"},
                 "tolerations": [{"key": "x", "operator": "Exists", "effect": "NoSchedule"}]},
    "agent": {"gpu": {"request": True, "count": 2}, "stateHostPath": "/var/lib/freetoken/state",
              "modelStoreHostPath": "/srv/freetoken/downloads",
              "runtimeClassName": "", "hostNetwork": False, "secretNamespaces": ["llm", "team-a"],
              "resources": {"limits": {"memory": "64Gi"}}, "extraArgs": ["--log-level=DEBUG"],
              "extraEnv": [{"name": "FREETOKEN_AGENT_HEADROOM_BYTES", "value": "2147483648"}]},
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                   "podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True, "ttftP95Seconds": 5},
                   "dashboards": {"namespace": "monitoring"}},
}
VALUES = {"default": {}, "non-default": NON_DEFAULT, "operator only": {"agent": {"enabled": False}}}


def render(values: dict) -> list[dict]:
    out = helm.Chart.load(CHART).render(values, name="ft", namespace="freetoken", is_install=True)
    return [d for path, text in out.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_chart_lints_clean(values):
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{K8S_VERSION}.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_rendered_objects_are_valid_kubernetes(values):
    docs = render(values)
    assert docs
    for doc in docs:
        if doc["kind"] in PROMETHEUS_OPERATOR_KINDS:
            continue   # not in kubernetes-validate's schemas; checked below
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_default_install_has_operator_agent_rbac_and_dashboards():
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in render({}))
    assert ("Deployment", "ft-freetoken-operator") in kinds
    assert ("DaemonSet", "ft-freetoken-agent") in kinds
    assert {k for k, _ in kinds} >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                                     "ConfigMap", "Service"}
    assert not {k for k, _ in kinds} & PROMETHEUS_OPERATOR_KINDS   # off by default


def test_crds_ship_with_the_chart_and_match_the_source():
    spec = importlib.util.spec_from_file_location("chart_generate", ROOT / "charts" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for path, data in gen.outputs().items():
        assert path.read_bytes() == data, f"{path} is stale: run python charts/generate.py"
    shipped = {c["name"]: c["data"] for c in helm.Chart.load(CHART).crds}   # what `helm install` applies
    assert sorted(shipped) == ["crds/freetoken.io_freetokenmodels.yaml", "crds/freetoken.io_freetokennodes.yaml"]
    for name, data in shipped.items():
        assert data == (ROOT / name).read_text()


def _pods(docs):
    for d in docs:
        if d["kind"] in ("Deployment", "DaemonSet"):
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_workloads_run_as_non_root_with_version_tags(values):
    for name, pod in _pods(render(values)):
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged")
            assert sc["capabilities"]["drop"] == ["ALL"] and sc["readOnlyRootFilesystem"] is True
            assert c["image"].endswith(f":{VERSION}"), (name, c["image"])


def test_non_default_values_take_effect():
    docs = render(NON_DEFAULT)
    pods = dict(_pods(docs))
    agent = pods["ft-freetoken-agent"]
    assert agent["containers"][0]["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": 2}
    assert agent["volumes"][1]["hostPath"]["path"] == "/var/lib/freetoken/state"
    volumes = {v["name"]: v for v in agent["volumes"]}
    assert volumes["downloads"]["hostPath"] == {"path": "/srv/freetoken/downloads", "type": "DirectoryOrCreate"}
    assert "--model-store=/var/lib/freetoken/downloads" in agent["containers"][0]["args"]
    default = {v["name"]: v for v in dict(_pods(render({})))["ft-freetoken-agent"]["volumes"]}
    assert default["downloads"] == {"name": "downloads", "emptyDir": {}}
    assert "runtimeClassName" not in agent and agent["hostNetwork"] is False
    assert "--log-level=DEBUG" in agent["containers"][0]["args"]
    operator = pods["ft-freetoken-operator"]
    assert "--stale-seconds=12" in operator["containers"][0]["args"] and "--verbose" in operator["containers"][0]["args"]
    assert "--api-timeout-seconds=7" in operator["containers"][0]["args"]
    roles = {(d["metadata"]["name"], d["metadata"]["namespace"]) for d in docs if d["kind"] == "Role"}
    assert roles == {(f"ft-freetoken-{who}-secrets", ns) for who in ("agent", "operator")
                     for ns in ("freetoken", "llm", "team-a")}
    maps = [d for d in docs if d["kind"] == "ConfigMap"]
    assert {m["metadata"]["namespace"] for m in maps} == {"monitoring"}
    assert {d["kind"] for d in docs} >= PROMETHEUS_OPERATOR_KINDS


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_rbac_is_least_privilege(values):
    docs = render(values)
    for d in docs:
        if d["kind"] in ("ClusterRole", "Role"):
            for rule in d["rules"]:
                for field in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule[field], (d["metadata"]["name"], rule)
                if "secrets" in rule["resources"]:   # never cluster-wide; the agent reads, the operator creates
                    who = d["metadata"]["labels"]["app.kubernetes.io/component"]
                    assert d["kind"] == "Role" and rule["verbs"] == {"agent": ["get"], "operator": ["create"]}[who]
        if d["kind"] in ("ClusterRoleBinding", "RoleBinding"):
            assert d["roleRef"]["name"] not in ("cluster-admin", "admin", "edit")


def test_dashboards_are_grafana_configmaps():
    maps = [d for d in render({}) if d["kind"] == "ConfigMap"]
    assert len(maps) == 2
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        (name, text), = cm["data"].items()
        dash = json.loads(text)
        assert dash["panels"] and all(p["targets"] for p in dash["panels"])
        assert name in ("fleet.json", "node.json")


@pytest.mark.parametrize("bad", [
    {"operator": {"staleSeconds": 0}},
    {"operator": {"apiTimeoutSeconds": 0}},
    {"agent": {"metricsPort": 80}},
    {"agent": {"modelsHostPath": "relative/path"}},
    {"agent": {"modelStoreHostPath": "downloads"}},
    {"agent": {"gpu": {"request": "yes"}}},
    {"monitoring": {"serviceMonitor": {"interval": "often"}}},
    {"typo": True},
], ids=["stale zero", "api timeout zero", "privileged metrics port", "relative host path", "relative store path", "bool as string", "bad interval", "unknown key"])
def test_values_schema_rejects_bad_values(bad):
    with pytest.raises(helm.HelmError):
        helm.Chart.load(CHART).render(bad, name="ft", namespace="freetoken")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_prometheus_rules_pass_promtool(tmp_path):
    rule = next(d for d in render(NON_DEFAULT) if d["kind"] == "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout
    assert "> 5" in yaml.safe_dump(rule["spec"])   # the non-default threshold reached the rule


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_cpu_contention_alert_fires_after_ten_minutes_of_workers_sitting_out(tmp_path):
    """promtool's rule unit test: a node whose engine keeps a CPU kernel worker out (another
    process on its CPU) alerts once that has lasted 10 minutes; a node without stays quiet."""
    rule = next(d for d in render(NON_DEFAULT) if d["kind"] == "PrometheusRule")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": [
            {"series": 'freetoken_cpu_workers_left_out{node="pc1",model="m"}', "values": "0 0 1x20"},
            {"series": 'freetoken_cpu_workers_left_out{node="pc2",model="m"}', "values": "0x22"}],
            "alert_rule_test": [
                {"eval_time": "8m", "alertname": "FreeTokenCPUContention", "exp_alerts": []},
                {"eval_time": "15m", "alertname": "FreeTokenCPUContention", "exp_alerts": [{
                    "exp_labels": {"severity": "info", "node": "pc1", "model": "m"},
                    "exp_annotations": {"summary": "m on pc1: 1 CPU kernel workers sitting out; another process "
                                                   "is using the engine's CPUs"}}]}]}]}))
    result = subprocess.run(["promtool", "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
