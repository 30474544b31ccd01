"""The operator, unmodified under kopf, against kmock over real HTTP.

FreeTokenNode statuses are written here the way an agent writes them (heartbeats, replica
states); tests/e2e runs the real agents and engines. Checks: placement into node specs, model
status and conditions, Service + EndpointSlices of ready replicas, events, a lost node's replica
moving within the stale timeout, and finalizer-driven cleanup on delete.
"""

from __future__ import annotations

import asyncio
import base64
import time

import pytest

import kmock_cluster as kc

STALE = 2.0


async def _spec_models(k, name: str) -> list[str]:
    body = await kc.get(k, kc.node_path(name))
    return [m["key"] for m in (body.get("spec") or {}).get("models") or []]


async def _mark_ready(k, name: str, ip: str) -> None:
    body = await kc.get(k, kc.node_path(name))
    reps = [{"key": m["key"], "state": "ready", "endpoint": f"http://{ip}:{m['port']}", "restarts": 0}
            for m in body["spec"]["models"]]
    await kc.patch(k, kc.node_path(name) + "/status", {"status": {"replicas": reps}})


@pytest.mark.timeout(60)
async def test_operator_places_serves_moves_and_cleans_up(kmock, monkeypatch):
    kc.prepare(kmock)
    ips = {"a": "127.0.0.11", "b": "127.0.0.12", "c": "127.0.0.13"}
    for name, ip in ips.items():
        kmock.objects[kc.NODES, None, name] = kc.node_body(name, ip)
    kmock.objects[kc.MODELS, "default", "m"] = kc.seeded({
        "apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenModel",
        "metadata": {"name": "m", "namespace": "default"},
        "spec": {"source": {"default": True}, "replicas": 2, "placement": {"strategy": "Spread"}}})
    # leftovers of an earlier operator run: a Service on an old port and a slice of a dead node
    kmock.objects["v1/services", "default", "m"] = kc.seeded({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "m", "namespace": "default"},
        "spec": {"ports": [{"name": "http", "port": 8080}]}})
    kmock.objects["discovery.k8s.io/v1/endpointslices", "default", "m-ipv4-9999"] = kc.seeded({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": "m-ipv4-9999", "namespace": "default", "labels": {
            "freetoken.io/model": "m", "app.kubernetes.io/managed-by": "freetoken-operator"}},
        "endpoints": [{"addresses": ["10.9.9.9"]}], "ports": [{"name": "http", "port": 9999}]})
    alive = set(ips)
    async with kc.running_operator(kmock, monkeypatch, alive, FREETOKEN_OPERATOR_STALE_SECONDS=str(STALE)) as runner:
        # 1. two replicas, spread over two nodes (equal nodes: by name)
        async def placed():
            return {n: await _spec_models(kmock, n) for n in ips}
        spec = await kc.wait_for(lambda: _both(placed), 10, "two placements")
        assert spec == {"a": ["default.m"], "b": ["default.m"], "c": []}
        model = await kc.get(kmock, kc.model_path("default", "m"))
        assert "freetoken.io/finalizer" in model["metadata"]["finalizers"]

        # 2. agents report ready -> status Ready, Service, EndpointSlice with both endpoints
        await _mark_ready(kmock, "a", ips["a"])
        await _mark_ready(kmock, "b", ips["b"])

        async def phase():
            body = await kc.get(kmock, kc.model_path("default", "m"))
            return (body.get("status") or {}).get("phase") == "Ready" and body
        model = await kc.wait_for(phase, 10, "phase Ready")
        conds = {c["type"]: c["status"] for c in model["status"]["conditions"]}
        assert conds == {"Scheduled": "True", "Ready": "True", "Degraded": "False", "MemoryPressure": "False"}
        assert model["status"]["ready"] == "2/2" and model["status"]["nodes"] == "a,b"
        # no apiKeySecret named: a generated key, owned by the model, named in the node specs
        assert model["status"]["apiKeySecret"] == "m-api-key"
        secret = await kc.get(kmock, "/api/v1/namespaces/default/secrets/m-api-key")
        assert len(base64.b64decode(secret["data"]["api-key"])) >= 32
        assert secret["metadata"]["ownerReferences"][0]["uid"] == model["metadata"]["uid"]
        entry = (await kc.get(kmock, kc.node_path("a")))["spec"]["models"][0]
        assert entry["apiKeySecret"] == {"name": "m-api-key", "key": "api-key"}
        svc = await kc.get(kmock, "/api/v1/namespaces/default/services/m")
        assert svc and "selector" not in svc["spec"] and svc["spec"]["ports"][0]["port"] == 80
        slices = await kc.items(kmock, "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices")
        addrs = sorted(e["addresses"][0] for s in slices for e in s["endpoints"])
        assert addrs == [ips["a"], ips["b"]]
        assert {s["metadata"]["labels"]["kubernetes.io/service-name"] for s in slices} == {"m"}

        # 3. node a stops heartbeating -> its replica moves to c within the stale timeout
        alive.discard("a")
        t0 = time.monotonic()
        await kc.wait_for(lambda: _moved(kmock), STALE + 5, "replica moved to c")
        moved_after = time.monotonic() - t0
        assert moved_after < STALE + 3, moved_after
        await _mark_ready(kmock, "c", ips["c"])

        async def serving_bc():
            sl = await kc.items(kmock, "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices")
            return sorted(e["addresses"][0] for s in sl for e in s["endpoints"]) == [ips["b"], ips["c"]]
        await kc.wait_for(serving_bc, 10, "EndpointSlice lists b and c")
        events = await kc.items(kmock, "/api/v1/namespaces/default/events")
        reasons = {e["reason"] for e in events}
        assert {"Placed", "NodeLost"} <= reasons
        lost = [e for e in events if e["reason"] == "NodeLost"]
        assert "heartbeat stale" in lost[0]["message"] and lost[0]["type"] == "Warning"

        # 4. delete -> finalizer empties node specs, removes Service and slices, object goes
        resp = await kmock.delete(kc.model_path("default", "m"))
        assert resp.status < 300

        async def gone():
            return await kc.get(kmock, kc.model_path("default", "m")) is None
        await kc.wait_for(gone, 15, "model deleted")
        assert await _spec_models(kmock, "b") == [] and await _spec_models(kmock, "c") == []
        assert await kc.get(kmock, "/api/v1/namespaces/default/services/m") is None
        assert await kc.items(kmock, "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices") == []
    assert runner.exit_code == 0, runner.output
    # the chart's ClusterRole allows every request the operator (kopf and apply.py) made
    used = kc.rbac_requests(kmock, ("kopf", "OpenAPI-Generator"))
    assert {("watch", "freetoken.io", "freetokennodes"), ("patch", "freetoken.io", "freetokenmodels/status"),
            ("create", "discovery.k8s.io", "endpointslices"), ("create", "", "events")} <= used
    rules = operator_rules("default")
    denied = {(v, g, r) for v, g, r in used
              if not any(g in rule["apiGroups"] and r in rule["resources"] and v in rule["verbs"] for rule in rules)}
    assert denied == set(), f"the chart's RBAC forbids {sorted(denied)}"
    # a real API server needs the patch type to match the body (kmock guesses from the body)
    patches = [kmock[i] for i in range(len(kmock)) if str(kmock[i].method).upper().endswith("PATCH")]
    assert patches
    for req in patches:
        ctype = req.headers.get("Content-Type", "")
        assert ("json-patch" in ctype) if isinstance(req.data, list) else ("merge-patch" in ctype), (req.url, ctype)
    assert "Traceback" not in runner.output, runner.output


def operator_rules(namespace: str) -> list[dict]:
    """The chart's (default values) rules for the operator: its ClusterRole's and its Role's in
    ``namespace`` (the generated API-key Secrets)."""
    import helm_python as helm
    import yaml
    from crdcheck import ROOT

    text = helm.Chart.load(ROOT / "charts" / "freetoken").render({}, name="ft", namespace="ft")
    docs = [d for d in yaml.safe_load_all(text["freetoken/templates/operator-rbac.yaml"]) if d]
    return [rule for d in docs if d["kind"] == "ClusterRole" or (
        d["kind"] == "Role" and d["metadata"]["namespace"] == namespace) for rule in d["rules"]]


async def _both(placed) -> dict | None:
    spec = await placed()
    return spec if sum(len(v) for v in spec.values()) == 2 else None


async def _moved(k) -> bool:
    return await _spec_models(k, "a") == [] and await _spec_models(k, "c") == ["default.m"]


@pytest.mark.timeout(60)
async def test_unsatisfiable_model_says_why_and_is_retried_when_nodes_change(kmock, monkeypatch):
    kc.prepare(kmock)
    kmock.objects[kc.NODES, None, "pc"] = kc.node_body("pc", "127.0.0.21")
    kmock.objects[kc.MODELS, "default", "big"] = kc.seeded({
        "apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenModel",
        "metadata": {"name": "big", "namespace": "default"},
        "spec": {"source": {"path": "/models/big"}, "placement": {"device": "gpu", "minVram": "16Gi"},
                 "memory": {"nonExpert": "4Gi", "minExpertCache": "2Gi", "kvCache": "1Gi"}}})
    alive = {"pc"}
    async with kc.running_operator(kmock, monkeypatch, alive) as runner:
        async def scheduled():
            body = await kc.get(kmock, kc.model_path("default", "big"))
            conds = {c["type"]: c for c in (body.get("status") or {}).get("conditions") or []}
            return conds.get("Scheduled")
        cond = await kc.wait_for(scheduled, 15, "a Scheduled condition")
        assert (cond["status"], cond["reason"]) == ("False", "Unschedulable")
        assert "0/1 replicas placed" in cond["message"] and "cpu-only" in cond["message"]
        async def unschedulable_events():   # events are posted asynchronously by kopf
            events = await kc.items(kmock, "/api/v1/namespaces/default/events")
            return [e["type"] for e in events if e["reason"] == "Unschedulable"]
        assert await kc.wait_for(unschedulable_events, 10, "an Unschedulable event") == ["Warning"]

        # the owner installs a 24 GiB GPU and the agent reports it: the model is placed
        await kc.patch(kmock, kc.node_path("pc") + "/status", {"status": {
            "mode": "gpu", "pcieGbps": 25.0, "gpu": {"name": "RTX 4090", "count": 1,
                                                      "vramTotalBytes": 24 * 2**30, "vramForeignBytes": 2**30}}})
        await kc.wait_for(lambda: _spec_models(kmock, "pc"), 10, "placement after the node changed")
        assert await _spec_models(kmock, "pc") == ["default.big"]
        cond = await kc.wait_for(lambda: _true(scheduled), 10, "Scheduled=True")
        assert cond["reason"] == "Placed"
        node = await kc.get(kmock, kc.node_path("pc"))
        assert node["spec"]["models"][0]["engine"] == {"device": "cuda", "dtype": "bfloat16",
                                                       "expertCacheShare": 0.9}
    assert runner.exit_code == 0, runner.output


async def _true(get_condition):
    cond = await get_condition()
    return cond if cond and cond["status"] == "True" else None


@pytest.mark.timeout(60)
async def test_memory_pressure_moves_the_lowest_priority_replica(kmock, monkeypatch):
    kc.prepare(kmock)
    for name, ip in (("a", "127.0.0.31"), ("b", "127.0.0.32")):
        body = kc.node_body(name, ip)
        body["status"].update(mode="gpu", pcieGbps=25.0, gpu={"name": "RTX 4090", "count": 1,
                                                               "vramTotalBytes": 24 * 2**30, "vramForeignBytes": 0})
        kmock.objects[kc.NODES, None, name] = body
    for name, prio in (("hi", 5), ("lo", 0)):   # Binpack: both start on node a
        kmock.objects[kc.MODELS, "default", name] = kc.seeded({
            "apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenModel",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"source": {"path": f"/models/{name}"}, "priority": prio,
                     "placement": {"device": "gpu", "strategy": "Binpack"}, "memory": {"nonExpert": "4Gi"}}})
    async with kc.running_operator(kmock, monkeypatch, {"a", "b"}) as runner:
        async def both_on_a():
            return sorted(await _spec_models(kmock, "a")) == ["default.hi", "default.lo"]
        await kc.wait_for(both_on_a, 15, "binpacked placement on a")
        # a game takes the VRAM back; the agent's caches hit their floor and it reports pressure
        running = [{"key": f"default.{m}", "state": "ready", "endpoint": f"http://127.0.0.31:{p}"}
                   for m, p in (("hi", 1919), ("lo", 1920))]
        await kc.patch(kmock, kc.node_path("a") + "/status", {"status": {
            "memoryPressure": True, "gpu": {"vramForeignBytes": 18 * 2**30}, "replicas": running}})

        async def moved():
            return (await _spec_models(kmock, "a") == ["default.hi"]
                    and await _spec_models(kmock, "b") == ["default.lo"])
        await kc.wait_for(moved, 10, "the low-priority replica to leave the pressured node")

        async def hi_pressure():
            st = (await kc.get(kmock, kc.model_path("default", "hi"))).get("status") or {}
            conds = {c["type"]: c for c in st.get("conditions") or []}
            return conds.get("MemoryPressure", {}).get("status") == "True" and conds["MemoryPressure"]
        cond = await kc.wait_for(hi_pressure, 10, "MemoryPressure on the model that stayed")
        assert cond["message"] == "under pressure: a"
        await asyncio.sleep(1.0)   # several passes: while lo's engine still runs on a, hi stays
        assert await _spec_models(kmock, "a") == ["default.hi"]
        # the agent stops lo; freeing its memory ended the pressure: nothing else moves
        await kc.patch(kmock, kc.node_path("a") + "/status", {"status": {
            "memoryPressure": False, "replicas": running[:1]}})
        await asyncio.sleep(1.0)
        assert await _spec_models(kmock, "a") == ["default.hi"]
        assert await _spec_models(kmock, "b") == ["default.lo"]
        events = await kc.items(kmock, "/api/v1/namespaces/default/events")
        assert [e["involvedObject"]["name"] for e in events if e["reason"] == "MemoryPressure"] == ["lo"]
    assert runner.exit_code == 0, runner.output


async def test_apply_repairs_owned_objects_deleted_behind_its_back(kmock):
    from freetoken_operator.apply import Applier, api_client
    from freetoken_operator.objects import endpoint_slices, service
    from freetoken_operator.status import DesiredState

    kc.prepare(kmock)
    model = {"metadata": {"name": "m", "namespace": "default", "uid": "u"}, "spec": {"serving": {"servicePort": 8080}}}
    state = DesiredState(node_specs={}, model_status={}, services=[service(model)],
                         slices={("default", "m"): endpoint_slices(model, [("a", "http://10.0.0.1:1919")])}, events=[])
    applier = Applier(api_client(str(kmock.url).rstrip("/")), refresh_seconds=0.5)
    svc_path = "/api/v1/namespaces/default/services/m"
    await asyncio.to_thread(applier.apply, state, {}, {})
    assert (await kc.get(kmock, svc_path))["spec"]["ports"][0]["port"] == 8080
    n_requests = len(kmock)
    await asyncio.to_thread(applier.apply, state, {}, {})
    assert len(kmock) == n_requests   # nothing changed: not a single request
    await kmock.delete(svc_path)
    await asyncio.sleep(0.6)
    await asyncio.to_thread(applier.apply, state, {}, {})
    assert (await kc.get(kmock, svc_path)) is not None   # recreated after the refresh interval
    slices = await kc.items(kmock, "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices")
    assert [s["metadata"]["name"] for s in slices] == ["m-ipv4-1919"]


async def test_a_model_is_reported_ready_only_after_its_endpoints_are_written(kmock):
    """A client that waits for Ready (``kubectl wait``) and then calls the Service must find the
    endpoints there: the Service and its EndpointSlices are written before the status."""
    from freetoken_operator.apply import Applier, api_client
    from freetoken_operator.objects import endpoint_slices, service
    from freetoken_operator.status import DesiredState

    kc.prepare(kmock)
    model = kc.seeded({"apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenModel",
                       "metadata": {"name": "m", "namespace": "default", "uid": "u"},
                       "spec": {"serving": {"servicePort": 8080}}})
    kmock.objects[kc.MODELS, "default", "m"] = model
    state = DesiredState(node_specs={}, model_status={("default", "m"): {"phase": "Ready", "ready": "1/1"}},
                         services=[service(model)],
                         slices={("default", "m"): endpoint_slices(model, [("a", "http://10.0.0.1:1919")])}, events=[])
    applier = Applier(api_client(str(kmock.url).rstrip("/")), refresh_seconds=60)
    first = len(kmock)
    await asyncio.to_thread(applier.apply, state, {}, {("default", "m"): model})
    writes = [(kmock[i].method, str(kmock[i].url)) for i in range(first, len(kmock)) if kmock[i].method != "GET"]
    status = [i for i, (_, url) in enumerate(writes) if url.split("?")[0].endswith("/freetokenmodels/m/status")]
    endpoints = [i for i, (_, url) in enumerate(writes) if "/endpointslices" in url or "/services" in url]
    assert status and endpoints, writes
    assert max(endpoints) < min(status), writes
    assert (await kc.get(kmock, kc.model_path("default", "m")))["status"]["phase"] == "Ready"


@pytest.mark.timeout(60)
async def test_examples_are_placed_as_documented(kmock, monkeypatch):
    import yaml
    from crdcheck import ROOT

    kc.prepare(kmock)
    kmock.objects[kc.NODES, None, "laptop"] = kc.node_body("laptop", "127.0.0.41")
    gaming = kc.node_body("gaming-pc", "127.0.0.42")
    gaming["status"].update(mode="gpu", pcieGbps=25.0, ramTotalBytes=128 * 2**30, gpu={
        "name": "RTX 4090", "count": 1, "vramTotalBytes": 24 * 2**30, "vramForeignBytes": 2 * 2**30})
    kmock.objects[kc.NODES, None, "gaming-pc"] = gaming
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            kind = {"FreeTokenModel": kc.MODELS, "Secret": "v1/secrets"}[doc["kind"]]
            kmock.objects[kind, doc["metadata"]["namespace"], doc["metadata"]["name"]] = kc.seeded(doc)
    async with kc.running_operator(kmock, monkeypatch, {"laptop", "gaming-pc"}) as runner:
        async def placed():
            specs = {n: (await kc.get(kmock, kc.node_path(n))).get("spec") or {} for n in ("laptop", "gaming-pc")}
            keys = {n: sorted(m["key"] for m in s.get("models") or []) for n, s in specs.items()}
            return keys == {"laptop": ["default.smollm2-moe"],
                            "gaming-pc": ["default.qwen3-30b-a3b", "default.qwen3-30b-a3b-lan",
                                          "default.smollm2-moe"]} and specs
        specs = await kc.wait_for(placed, 15, "both examples placed")
    assert runner.exit_code == 0, runner.output
    qwen = next(m for m in specs["gaming-pc"]["models"] if m["model"] == "qwen3-30b-a3b")
    assert qwen["source"] == {"path": "/models/qwen3-30b-a3b"} and qwen["format"] == "safetensors"
    assert qwen["engine"] == {"device": "cuda", "dtype": "bfloat16", "expertCacheShare": 0.9, "contextLength": 8192,
                              "features": {"decodePauseMs": 100}}
    assert qwen["apiKeySecret"] == {"name": "qwen3-api-key", "key": "api-key"}
    lan = next(m for m in specs["gaming-pc"]["models"] if m["model"] == "qwen3-30b-a3b-lan")
    assert lan["source"] == {"url": "http://nas.lan:8080/models/qwen3-30b-a3b.tar"}   # fetched by the agent
    smol = [m for s in specs.values() for m in s["models"] if m["model"] == "smollm2-moe"]
    assert {m["engine"]["device"] for m in smol} == {"cpu", "cuda"} and {m["format"] for m in smol} == {"default"}
    ports = [m["port"] for m in specs["gaming-pc"]["models"]]
    assert len(set(ports)) == 3   # engines on one node never share a port
