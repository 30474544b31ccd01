"""The operator's API keys against kmock over real HTTP: a random key generated only where a
model names no Secret, never rewritten, owned by the model, and made again for a model applied
again under its old name."""

from __future__ import annotations

import asyncio
import base64

import pytest

import kmock_cluster as kc


@pytest.mark.timeout(60)
async def test_api_keys_are_generated_only_where_none_is_named_and_never_overwritten(kmock, monkeypatch):
    """Secure by default: a model that names no Secret gets a random key in <name>-api-key; one
    that names its own keeps it; ``auth: none`` serves without one; a Secret that already has
    the generated name (an earlier run's) is left as it is."""
    kc.prepare(kmock)
    kmock.objects[kc.NODES, None, "a"] = kc.node_body("a", "127.0.0.21")
    specs = {"gen": {}, "own": {"apiKeySecret": {"name": "own-key", "key": "k"}}, "open": {"auth": "none"},
             "again": {}}
    for name, serving in specs.items():
        kmock.objects[kc.MODELS, "default", name] = kc.seeded({
            "apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenModel",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"source": {"default": True}, "serving": serving}})
    earlier = base64.b64encode(b"an earlier run's key").decode()
    kmock.objects["v1/secrets", "default", "again-api-key"] = kc.seeded({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "again-api-key", "namespace": "default"},
        "data": {"api-key": earlier}})
    async with kc.running_operator(kmock, monkeypatch, {"a"}) as runner:
        async def placed():
            body = await kc.get(kmock, kc.node_path("a"))
            models = (body.get("spec") or {}).get("models") or []
            return len(models) == 4 and {m["model"]: m.get("apiKeySecret") for m in models}
        refs = await kc.wait_for(placed, 15, "four models placed")

        async def reported():   # the statuses are written after the node specs
            st = {n: (await kc.get(kmock, kc.model_path("default", n))).get("status") or {} for n in specs}
            return all("phase" in v for v in st.values()) and st
        statuses = await kc.wait_for(reported, 15, "four statuses")
    assert runner.exit_code == 0, runner.output
    assert refs == {"gen": {"name": "gen-api-key", "key": "api-key"}, "own": {"name": "own-key", "key": "k"},
                    "open": None, "again": {"name": "again-api-key", "key": "api-key"}}
    assert {n: s.get("apiKeySecret") for n, s in statuses.items()} == {
        "gen": "gen-api-key", "own": "own-key", "open": None, "again": "again-api-key"}
    secrets = {s["metadata"]["name"]: s for s in await kc.items(kmock, "/api/v1/namespaces/default/secrets")}
    assert set(secrets) == {"gen-api-key", "again-api-key"}
    assert secrets["again-api-key"]["data"]["api-key"] == earlier        # never rewritten
    key = base64.b64decode(secrets["gen-api-key"]["data"]["api-key"]).decode()
    assert len(key) >= 32 and key not in runner.output                    # random, and not logged
    creates = [kmock[i] for i in range(len(kmock)) if "/secrets" in str(kmock[i].url.path)
               and str(kmock[i].method).upper().endswith("POST")]
    assert len(creates) == 2        # created once each (the second a 409), not on every pass
    used = {(v, r) for v, _, r in kc.rbac_requests(kmock, ("kopf", "OpenAPI-Generator")) if r == "secrets"}
    assert used == {("create", "secrets")}          # the operator never reads Secrets


async def test_a_model_made_again_under_its_old_name_gets_a_new_key_secret_at_once(kmock):
    """Kubernetes deletes the old model's generated Secret with it (owner reference); a model
    applied again under that name must get a new one on the next pass, not after the applier's
    refresh interval (its agents would report the key missing meanwhile)."""
    from freetoken_operator.apply import Applier, api_client
    from freetoken_operator.objects import generated_key_secret
    from freetoken_operator.status import DesiredState

    kc.prepare(kmock)
    applier = Applier(api_client(str(kmock.url).rstrip("/")), refresh_seconds=600)
    path = "/api/v1/namespaces/default/secrets/m-api-key"
    keys = []
    for uid in ("first", "second"):
        model = {"metadata": {"name": "m", "namespace": "default", "uid": uid}, "spec": {}}
        state = DesiredState(node_specs={}, model_status={}, services=[], slices={}, events=[],
                             secrets=[generated_key_secret(model)])
        await asyncio.to_thread(applier.apply, state, {}, {})
        secret = await kc.get(kmock, path)
        assert secret["metadata"]["ownerReferences"][0]["uid"] == uid
        keys.append(secret["data"]["api-key"])
        await kmock.delete(path)      # the garbage collector, when the model is deleted
    assert keys[0] != keys[1]
