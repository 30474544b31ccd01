"""The CRDs accept the examples, the contract's FreeTokenNode and the operator's own status
writes, apply the documented defaults, and reject bad objects with a message that says why."""

from __future__ import annotations

import datetime as dt

import kubernetes_validate
import pytest
import yaml

from crdcheck import ROOT, load_crd, validate
from freetoken_operator.objects import node_entry
from freetoken_operator.observe import NodeView, ReplicaView, model_view
from freetoken_operator.plan import plan
from freetoken_operator.status import desired

MODELS, NODES = load_crd("freetokenmodels"), load_crd("freetokennodes")


def ftm(spec, name="m"):
    return {"apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenModel",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}


@pytest.mark.parametrize("plural", ["freetokenmodels", "freetokennodes"])
def test_crds_are_valid_kubernetes_objects(plural):
    kubernetes_validate.validate(load_crd(plural), "1.33", strict=True)


def test_examples_pass_the_schema():
    seen = 0
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] == "FreeTokenModel":
                _, errors = validate(MODELS, doc)
                assert errors == [], f"{path.name}: {errors}"
                assert model_view(doc).unsupported is None, path.name   # the operator can place it
                seen += 1
    assert seen >= 2


def test_defaults_fill_a_minimal_model():
    obj, errors = validate(MODELS, ftm({"source": {"default": True}}))
    assert errors == []
    spec = obj["spec"]
    assert spec["replicas"] == 1 and spec["priority"] == 0
    assert spec["placement"] == {"device": "any", "strategy": "Spread"}
    assert spec["engine"] == {"expertCacheShare": 0.9}
    assert spec["serving"] == {"servicePort": 80, "auth": "apiKey"}     # a key unless told otherwise
    entry = node_entry(obj, 1919, "cpu")
    assert entry["apiKeySecret"] == {"name": "m-api-key", "key": "api-key"}   # the generated Secret


@pytest.mark.parametrize("features,method", [
    ({"decodePauseMs": 100}, "ngram"),                                  # default filled in
    ({"speculativeTokens": 4}, "ngram"),
    ({"speculativeTokens": 4, "speculativeMethod": "mtp"}, "mtp"),
    ({"speculativeTokens": 0, "speculativeMethod": "ngram"}, "ngram"),  # ngram with drafts off is fine
])
def test_speculative_method_defaults_and_passes_to_the_node(features, method):
    body, errors = validate(MODELS, ftm({"source": {"default": True}, "engine": {"features": features}}))
    assert errors == []
    assert body["spec"]["engine"]["features"] == dict(features, speculativeMethod=method)
    entry = node_entry(body, 1919, "cpu")          # the operator hands the features on unchanged
    assert entry["engine"]["features"] == dict(features, speculativeMethod=method)
    node = {"apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenNode", "metadata": {"name": "a"},
            "spec": {"models": [entry]}}
    assert validate(NODES, node)[1] == []


BAD = [
    ("no source", {"source": {}}, "exactly one of source"),
    ("two sources", {"source": {"path": "/m", "url": "https://x/m"}}, "exactly one of source"),
    ("default false only", {"source": {"default": False}}, "exactly one of source"),
    ("relative path", {"source": {"path": "models/x"}}, "does not match"),
    ("bad sha256", {"source": {"url": "https://x/m.gguf", "sha256": "abc"}}, "does not match"),
    ("sha256 on a pvc", {"source": {"pvc": {"claimName": "c"}, "sha256": "a" * 64}}, "sha256"),
    ("format default with a path", {"source": {"path": "/m"}, "format": "default"}, "format 'default'"),
    ("default source, other format", {"source": {"default": True}, "format": "gguf"}, "format 'default'"),
    ("gguf on a pvc", {"source": {"pvc": {"claimName": "c"}}, "format": "gguf"}, "single file"),
    ("negative replicas", {"source": {"default": True}, "replicas": -1}, "minimum"),
    ("too many replicas", {"source": {"default": True}, "replicas": 65}, "maximum"),
    ("unknown strategy", {"source": {"default": True}, "placement": {"strategy": "Random"}}, "is not one of"),
    ("bad quantity", {"source": {"default": True}, "memory": {"nonExpert": "12 GB"}}, "does not match"),
    ("cache share zero", {"source": {"default": True}, "engine": {"expertCacheShare": 0}}, "minimum"),
    ("cache share above one", {"source": {"default": True}, "engine": {"expertCacheShare": 1.5}}, "maximum"),
    ("pcie minimum on cpu", {"source": {"default": True}, "placement": {"device": "cpu", "minPcieGbps": 8}},
     "minPcieGbps needs GPU"),
    ("Exists toleration with value", {"source": {"default": True}, "placement": {
        "tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}}, "takes no value"),
    ("privileged port", {"source": {"default": True}, "serving": {"port": 80}}, "minimum"),
    ("negative decode pause", {"source": {"default": True}, "engine": {"features": {"decodePauseMs": -5}}},
     "minimum"),
    ("negative state checkpoints", {"source": {"default": True}, "engine": {"features": {"stateCheckpoints": -1}}},
     "minimum"),
    ("too many draft tokens", {"source": {"default": True}, "engine": {"features": {"speculativeTokens": 17}}},
     "maximum"),
    ("unknown speculative method", {"source": {"default": True},
                                    "engine": {"features": {"speculativeTokens": 4, "speculativeMethod": "eagle"}}},
     "is not one of"),
    ("mtp without draft tokens", {"source": {"default": True}, "engine": {"features": {"speculativeMethod": "mtp"}}},
     "mtp drafts nothing"),
    ("mtp with zero draft tokens", {"source": {"default": True},
                                    "engine": {"features": {"speculativeMethod": "mtp", "speculativeTokens": 0}}},
     "mtp drafts nothing"),
    ("fractional prefill chunk", {"source": {"default": True}, "engine": {"features": {"prefillChunk": 2.5}}},
     "is not of type"),
    ("unknown field", {"source": {"default": True}, "replica": 2}, "Additional properties"),
    ("unknown auth", {"source": {"default": True}, "serving": {"auth": "basic"}}, "is not one of"),
    ("auth none with a key", {"source": {"default": True},
                              "serving": {"auth": "none", "apiKeySecret": {"name": "s"}}}, "auth none serves without a key"),
]


@pytest.mark.parametrize("spec,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_models_are_rejected(spec, fragment):
    _, errors = validate(MODELS, ftm(spec))
    assert errors, "accepted a bad object"
    assert any(fragment in e for e in errors), errors


CONTRACT_NODE = {
    "apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenNode", "metadata": {"name": "pc1"},
    "spec": {"models": [{
        "key": "default.my-model", "namespace": "default", "model": "my-model",
        "source": {"path": "/models/qwen3"}, "format": "safetensors", "port": 1919,
        "engine": {"device": "cuda", "dtype": "bfloat16", "expertCacheShare": 0.9, "contextLength": 8192},
        "apiKeySecret": {"name": "s", "key": "k"}}]},
    "status": {
        "heartbeat": "2026-11-29T12:00:00Z", "mode": "gpu", "address": "10.0.0.5",
        "gpu": {"name": "NVIDIA H200", "count": 1, "vramTotalBytes": 1, "vramUsedBytes": 1,
                "vramOursBytes": 1, "vramForeignBytes": 1},
        "cpuCores": 16, "ramTotalBytes": 1, "ramAvailableBytes": 1, "pcieGbps": None,
        "cpuExpertGbps": 21.0, "fillFraction": 0.7, "memoryPressure": False, "storedSha256": ["ab" * 32],
        "replicas": [{"key": "default.my-model", "state": "starting", "endpoint": "http://10.0.0.5:1919",
                      "expertCacheBytes": 123, "restarts": 0, "message": ""}],
        "conditions": []},
}


def test_contract_node_passes():
    assert validate(NODES, CONTRACT_NODE)[1] == []


@pytest.mark.parametrize("mutate,fragment", [
    (lambda n: n["spec"]["models"].append(dict(n["spec"]["models"][0], key="b.x", namespace="b", model="x")),
     "cannot share a port"),
    (lambda n: n["spec"]["models"][0].update(key="wrong"), "key must be"),
    (lambda n: n["status"]["replicas"][0].update(state="running"), "is not one of"),
    (lambda n: n["status"].update(fillFraction=1.5), "maximum"),
    (lambda n: n["status"].update(storedSha256=["AB" * 32]), "does not match"),
], ids=["duplicate port", "key mismatch", "unknown replica state", "q* above one", "sha256 not lowercase hex"])
def test_bad_nodes_are_rejected(mutate, fragment):
    node = yaml.safe_load(yaml.safe_dump(CONTRACT_NODE))
    mutate(node)
    errors = validate(NODES, node)[1]
    assert any(fragment in e for e in errors), errors


def test_operator_writes_schema_valid_status_and_node_specs():
    body = ftm({"source": {"default": True}, "replicas": 2})
    body["metadata"]["uid"] = "u1"
    body = validate(MODELS, body)[0]
    nodes = [NodeView("a", 1.0, mode="cpu", ram_total_bytes=2**34,
                      replicas={"default.m": ReplicaView("ready", "http://127.0.0.1:1919")}),
             NodeView("b", 2.0, mode="cpu", ram_total_bytes=2**34,
                      replicas={"default.m": ReplicaView("starting", None, "fetching 1.20 of 61.00 GB from https://h/m")})]
    result = plan([model_view(body)], nodes, {})
    state = desired({("default", "m"): body}, nodes, result, stale_seconds=30,
                    now=dt.datetime(2026, 11, 29, tzinfo=dt.timezone.utc))
    status = state.model_status[("default", "m")]
    assert status["phase"] == "Degraded" and status["ready"] == "1/2"   # 1 of 2 serving
    rows = {r["node"]: r for r in status["placements"]}
    assert "message" not in rows["a"] and rows["b"]["message"] == "fetching 1.20 of 61.00 GB from https://h/m"
    assert [c["status"] for c in status["conditions"]] == ["True", "True", "True", "False"]   # placed, degraded
    assert validate(MODELS, dict(body, status=status))[1] == []
    node = {"apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenNode", "metadata": {"name": "a"},
            "spec": {"models": state.node_specs["a"]}}
    assert validate(NODES, node)[1] == []
    assert state.node_specs["a"][0]["engine"]["device"] == "cpu"


def _jsonpath(obj, path: str) -> list:
    """The subset of JSONPath printer columns use here: dotted names and ``[*]``."""
    values = [obj]
    for part in path.lstrip(".").split("."):
        name, star = (part[:-3], True) if part.endswith("[*]") else (part, False)
        values = [v.get(name) for v in values if isinstance(v, dict) and v.get(name) is not None]
        if star:
            values = [item for v in values for item in v]
    return values


def test_printer_columns_show_data():
    body = validate(MODELS, dict(ftm({"source": {"default": True}}), metadata={
        "name": "m", "namespace": "default", "uid": "u", "creationTimestamp": "2026-11-29T12:00:00Z"}))[0]
    nodes = [NodeView("a", 1.0, mode="cpu", ram_total_bytes=2**34,
                      replicas={"default.m": ReplicaView("ready", "http://127.0.0.1:1919")})]
    state = desired({("default", "m"): body}, nodes, plan([model_view(body)], nodes, {}), stale_seconds=30,
                    now=dt.datetime(2026, 11, 29, tzinfo=dt.timezone.utc))
    model = dict(body, status=state.model_status[("default", "m")])
    node = dict(CONTRACT_NODE, metadata={"name": "pc1", "creationTimestamp": "2026-11-29T12:00:00Z"})
    node["status"] = dict(node["status"], pcieGbps=48.6)
    for crd, obj, expected in ((MODELS, model, {"Phase": ["Ready"], "Ready": ["1/1"], "Nodes": ["a"]}),
                               (NODES, node, {"GPU": ["NVIDIA H200"], "PCIe GB/s": [48.6], "q*": [0.7],
                                              "Models": ["my-model"], "Ready": ["starting"]})):
        columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
        shown = {c["name"]: _jsonpath(obj, c["jsonPath"]) for c in columns}
        assert all(shown.values()), shown   # every column has a value, Age included
        for name, value in expected.items():
            assert shown[name] == value
