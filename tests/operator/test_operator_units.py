"""Configuration, command line, import hygiene and status bookkeeping of the operator."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys

import pytest

from freetoken_operator.cli import main
from freetoken_operator.config import ConfigError, OperatorConfig
from freetoken_operator.objects import endpoint_slices
from freetoken_operator.observe import NodeView, ReplicaView, Store, model_view
from freetoken_operator.plan import plan
from freetoken_operator.status import desired

T0 = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.timezone.utc)


def test_stale_timeout_defaults_to_30s_and_is_configurable():
    assert OperatorConfig.from_env({}).stale_seconds == 30.0
    assert OperatorConfig.from_env({"FREETOKEN_OPERATOR_STALE_SECONDS": "7.5"}).stale_seconds == 7.5
    # the flag wins over the environment
    assert OperatorConfig.from_env({"FREETOKEN_OPERATOR_STALE_SECONDS": "7.5"}, stale_seconds=12).stale_seconds == 12


@pytest.mark.parametrize("env", [{"FREETOKEN_OPERATOR_STALE_SECONDS": "0"},
                                 {"FREETOKEN_OPERATOR_STALE_SECONDS": "soon"},
                                 {"FREETOKEN_OPERATOR_KUBE_SERVER": "localhost:6443"},
                                 {"FREETOKEN_OPERATOR_BASE_PORT": "70000"},
                                 {"FREETOKEN_OPERATOR_API_TIMEOUT_SECONDS": "-1"}])
def test_bad_configuration_is_rejected(env):
    with pytest.raises(ConfigError):
        OperatorConfig.from_env(env)


@pytest.mark.parametrize("args,says", [
    (["--stale-seconds", "-1"], "stale_seconds must be > 0"),
    (["--api-timeout-seconds", "0"], "api_timeout_seconds must be in (0, 600]"),
    (["--liveness", "garbage"], "--liveness: must be http://HOST:PORT/PATH"),     # kopf: a traceback
    (["--liveness", "https://0.0.0.0:8080/healthz"], "--liveness: must be http://"),
    (["--liveness", "http://0.0.0.0:port/healthz"], "--liveness: must be http://"),
    (["--base-port", "x"], "--base-port: invalid int value"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_cli_rejects_bad_flags_with_one_line_and_exit_code_2(capsys, args, says):
    try:
        code = main(args)
    except SystemExit as exc:       # argparse's errors
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err


@pytest.mark.timeout(120)
def test_an_api_server_that_never_answers_ends_the_operator_in_one_line():
    """kopf tries 5 times (about 20 s), then the operator exits 1 (the pod restarts) with one
    line naming the server; kopf's traceback of the connection error (40 lines) is not shown."""
    p = subprocess.run([sys.executable, "-m", "freetoken_operator.cli", "--kube-server", "http://127.0.0.1:9"],
                       capture_output=True, text=True, timeout=110)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1].startswith(
        "freetoken-operator: cannot reach the Kubernetes API at http://127.0.0.1:9: "), p.stderr[-1000:]


def test_operator_never_imports_torch_or_the_engine():
    code = ("import sys, freetoken_operator.handlers, freetoken_operator.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'freetoken_engine', 'freetoken_agent')]; "
            "print(bad); raise SystemExit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _model(**status):
    body = {"metadata": {"name": "m", "namespace": "default", "uid": "u"},
            "spec": {"source": {"default": True}, "replicas": 1}}
    if status:
        body["status"] = status
    return body


def test_conditions_keep_their_transition_time_and_events_fire_once():
    nodes = [NodeView("a", 1.0, mode="cpu", ram_total_bytes=2**33)]
    body = _model()
    first = desired({("default", "m"): body}, nodes, plan([model_view(body)], nodes, {}), stale_seconds=30, now=T0)
    status = first.model_status[("default", "m")]
    assert [e.reason for e in first.events] == ["Placed"]
    later = T0 + dt.timedelta(minutes=5)
    body = _model(**status)
    again = desired({("default", "m"): body}, nodes, plan([model_view(body)], nodes, {"default.m": {"a": 1919}}),
                    stale_seconds=30, now=later)
    assert again.events == []   # nothing changed, nothing to say
    assert again.model_status[("default", "m")]["conditions"] == status["conditions"]
    ready_nodes = [NodeView("a", 1.0, mode="cpu", ram_total_bytes=2**33,
                            replicas={"default.m": ReplicaView("ready", "http://10.0.0.1:1919")})]
    turned = desired({("default", "m"): body}, ready_nodes,
                     plan([model_view(body)], ready_nodes, {"default.m": {"a": 1919}}), stale_seconds=30, now=later)
    conds = {c["type"]: c for c in turned.model_status[("default", "m")]["conditions"]}
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["lastTransitionTime"] == "2026-11-29T12:05:00Z"
    assert conds["Scheduled"]["lastTransitionTime"] == "2026-11-29T12:00:00Z"


def test_unschedulable_model_says_why_once():
    nodes = [NodeView("a", 1.0, mode="cpu", ram_total_bytes=2**33)]
    body = _model()
    body["spec"]["placement"] = {"device": "gpu"}
    state = desired({("default", "m"): body}, nodes, plan([model_view(body)], nodes, {}), stale_seconds=30, now=T0)
    sched = state.model_status[("default", "m")]["conditions"][0]
    assert (sched["type"], sched["status"], sched["reason"]) == ("Scheduled", "False", "Unschedulable")
    assert "1 node is cpu-only" in sched["message"]
    assert [(e.type, e.reason) for e in state.events] == [("Warning", "Unschedulable")]
    body["status"] = state.model_status[("default", "m")]
    again = desired({("default", "m"): body}, nodes, plan([model_view(body)], nodes, {}), stale_seconds=30, now=T0)
    assert again.events == []


def test_endpoint_slices_group_by_port_and_address_type():
    slices = endpoint_slices(_model(), [("a", "http://10.0.0.1:1919"), ("b", "http://10.0.0.2:1919"),
                                        ("c", "http://10.0.0.3:1920"), ("d", "http://pc-d.lan:1919")])
    shape = [(s["metadata"]["name"], s["addressType"], s["ports"][0]["port"],
              [e["addresses"][0] for e in s["endpoints"]]) for s in slices]
    assert shape == [("m-fqdn-1919", "FQDN", 1919, ["pc-d.lan"]),
                     ("m-ipv4-1919", "IPv4", 1919, ["10.0.0.1", "10.0.0.2"]),
                     ("m-ipv4-1920", "IPv4", 1920, ["10.0.0.3"])]


def test_store_ages_heartbeats_on_the_operator_clock():
    store = Store()
    node = {"metadata": {"name": "a"}, "status": {"heartbeat": "2026-11-29T11:59:00Z", "mode": "cpu"}}
    store.put_node(node, now=T0)                      # first sighting of a 60 s old heartbeat
    assert store.node_views(T0)[0].heartbeat_age_s == 60.0
    node["status"]["heartbeat"] = "2099-01-01T00:00:00Z"   # a node clock far in the future
    store.put_node(node, now=T0 + dt.timedelta(seconds=1))
    assert store.node_views(T0 + dt.timedelta(seconds=3))[0].heartbeat_age_s == 2.0
    store.put_node(node, now=T0 + dt.timedelta(seconds=40))   # same value again: no new beat
    assert store.node_views(T0 + dt.timedelta(seconds=40))[0].heartbeat_age_s == 39.0


def test_a_node_holds_a_url_model_its_agent_stored():
    digest = "ab" * 32
    store = Store()
    store.put_node({"metadata": {"name": "a"}, "status": {"heartbeat": "2026-11-29T11:59:59Z",
                                                          "storedSha256": [digest]}}, now=T0)
    [node] = store.node_views(T0)
    stored = model_view({"metadata": {"name": "m", "namespace": "default"},
                         "spec": {"source": {"url": "https://h/m.tar", "sha256": digest}}})
    unnamed = model_view({"metadata": {"name": "u", "namespace": "default"},
                          "spec": {"source": {"url": "https://h/m.tar"}}})
    assert node.holds(stored) and not node.holds(unnamed)


@pytest.mark.parametrize("source,supported", [
    ({"path": "/models/x"}, True), ({"default": True}, True),
    ({"url": "https://example.org/m.gguf"}, True), ({"pvc": {"claimName": "weights"}}, False)])
def test_sources_the_agents_cannot_load_are_flagged(source, supported):
    view = model_view({"metadata": {"name": "m", "namespace": "default"}, "spec": {"source": source}})
    assert (view.unsupported is None) == supported
