"""The whole fleet on loopback: kmock serves the Kubernetes API over HTTP, the operator runs as
its console script (``freetoken-operator``, kopf unmodified), three ``freetoken-agent run``
processes are three nodes, each starting real ``freetoken serve`` engines on a tiny checkpoint.

A user applies a FreeTokenModel with two replicas (no Secret named: the operator generates the
API key); the engines start; a chat completion through an EndpointSlice endpoint answers with
that key and is refused without it (official ``openai`` client); editing the Secret rotates the
key in the running engines; one node is switched off (its
agent and engine killed): the surviving replica keeps answering and the lost one is re-placed on
the third node within the stale timeout; deleting the model stops every engine.
"""

from __future__ import annotations

import base64
import signal
import subprocess
import time

import httpx
import openai
import pytest

import fleet
import kmock_cluster as kc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
STALE = 4.0
BASE_PORT = 1919


async def _slice_endpoints(k) -> list[tuple[str, str, int]]:
    slices = await kc.items(k, "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices")
    return sorted((e["nodeName"], e["addresses"][0], s["ports"][0]["port"])
                  for s in slices if s["metadata"]["labels"].get("kubernetes.io/service-name") == "tiny"
                  for e in s["endpoints"])


async def _api_key(k) -> str:
    """The key the operator generated for the model (it names no Secret), as a user reads it:
    kubectl get secret tiny-api-key -o jsonpath='{.data.api-key}' | base64 -d."""
    secret = await kc.get(k, "/api/v1/namespaces/default/secrets/tiny-api-key")
    return base64.b64decode(secret["data"]["api-key"]).decode()


async def _chat(addr: str, port: int, key: str) -> str:
    client = openai.AsyncOpenAI(base_url=f"http://{addr}:{port}/v1", api_key=key, max_retries=0, timeout=60)
    try:
        reply = await client.chat.completions.create(
            model="tiny", max_tokens=8, temperature=0, messages=[{"role": "user", "content": "Say hi"}])
    finally:
        await client.close()
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1
    return reply.choices[0].message.content


async def _status(k) -> dict:
    body = await kc.get(k, kc.model_path("default", "tiny"))
    return (body or {}).get("status") or {}


async def test_fleet_serves_survives_a_lost_node_and_cleans_up(kmock, tmp_path, tiny_checkpoint):
    ckpt = tiny_checkpoint("qwen3_moe", max_position_embeddings=1024)
    kc.prepare(kmock)
    server = str(kmock.url).rstrip("/")
    liveness = f"http://127.0.0.1:{fleet.free_port()}/healthz"   # the chart's livenessProbe target
    operator = subprocess.Popen(
        [fleet.script("freetoken-operator"), "--kube-server", server, "--liveness", liveness, "--stale-seconds", str(STALE), "--resync-seconds", "0.3"],
        stdout=open(tmp_path / "operator.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    nodes = ["n1", "n2", "n3"]
    offsets = {n: fleet.free_port() - BASE_PORT for n in nodes}
    agents = {n: fleet.start_agent(tmp_path, n, metrics_port=fleet.free_port(), port_offset=offsets[n],
                                   kube_server=server, heartbeat=0.5,
                                   env=fleet.agent_env(FREETOKEN_AGENT_KEY_RECHECK_SECONDS="0.5"))
              for n in nodes}
    try:
        async def registered():
            return {n["metadata"]["name"] for n in await kc.items(kmock, kc.node_path())
                    if (n.get("status") or {}).get("heartbeat")} == set(nodes)
        await kc.wait_for(registered, 60, "three agents to report their FreeTokenNodes", step=0.3)

        async def alive():
            async with httpx.AsyncClient() as http:
                try:
                    return (await http.get(liveness, timeout=5)).status_code == 200
                except httpx.HTTPError:
                    return False
        await kc.wait_for(alive, 30, "the operator's liveness endpoint", step=0.3)

        # kubectl apply (kmock assigns no resourceVersion/uid, so the body carries them)
        resp = await kmock.post(kc.model_path("default"), json=kc.seeded({
            "apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenModel",
            "metadata": {"name": "tiny", "namespace": "default"},
            "spec": {"source": {"path": str(ckpt)}, "format": "safetensors", "replicas": 2,
                     "engine": {"device": "cpu", "dtype": "float32", "expertCacheShare": 0.9}}}))
        assert resp.status < 300, await resp.text()

        async def ready():
            st = await _status(kmock)
            return st.get("phase") == "Ready" and len(await _slice_endpoints(kmock)) == 2 and st
        status = await kc.wait_for(ready, 150, "two replicas Ready and published", step=0.3)
        assert status["ready"] == "2/2"
        endpoints = await _slice_endpoints(kmock)
        key = await _api_key(kmock)
        assert status["apiKeySecret"] == "tiny-api-key"
        for node, addr, port in endpoints:
            assert port == BASE_PORT + offsets[node]   # the agent's real engine port, as reported
            assert await _chat(addr, port, key)
        with pytest.raises(openai.AuthenticationError):   # secure by default: no key, no answer
            await _chat(endpoints[0][1], endpoints[0][2], "not-the-key")

        # the user rotates the key by editing the Secret: the running engines take it, no restart
        pids = {n: fleet.engine_pids(p) for n, _, p in endpoints}
        assert all(pids.values())
        await kc.patch(kmock, "/api/v1/namespaces/default/secrets/tiny-api-key",
                       {"data": {"api-key": base64.b64encode(b"rotated-key").decode()}})

        async def rotated():
            try:
                for _, addr, port in endpoints:
                    await _chat(addr, port, "rotated-key")
                return True
            except openai.AuthenticationError:
                return False
        await kc.wait_for(rotated, 20, "both engines to take the rotated key", step=0.3)
        with pytest.raises(openai.AuthenticationError):
            await _chat(endpoints[0][1], endpoints[0][2], key)
        assert {n: fleet.engine_pids(p) for n, _, p in endpoints} == pids    # the same processes
        key = "rotated-key"

        # switch one PC off: its agent and its engine die without a word
        lost, (survivor_addr, survivor_port) = endpoints[0][0], endpoints[1][1:]
        spare = next(n for n in nodes if n not in {e[0] for e in endpoints})
        fleet.stop(agents[lost], sig=signal.SIGKILL)
        t_lost = time.monotonic()
        assert await _chat(survivor_addr, survivor_port, key)   # the model keeps answering

        async def moved():
            spec = (await kc.get(kmock, kc.node_path(spare))).get("spec") or {}
            return [m["key"] for m in spec.get("models") or []] == ["default.tiny"]
        await kc.wait_for(moved, STALE + 10, f"the replica to move to {spare}", step=0.2)
        moved_after = time.monotonic() - t_lost
        assert moved_after < STALE + 5, f"re-placed after {moved_after:.1f}s"

        async def serving_again():
            eps = await _slice_endpoints(kmock)
            return sorted(e[0] for e in eps) == sorted({endpoints[1][0], spare}) and eps
        endpoints = await kc.wait_for(serving_again, 120, "the moved replica to serve", step=0.3)
        for _, addr, port in endpoints:
            assert await _chat(addr, port, key)
        events = await kc.items(kmock, "/api/v1/namespaces/default/events")
        assert any(e["reason"] == "NodeLost" and lost in e["message"] for e in events)

        # kubectl delete: the finalizer empties the node specs, the agents stop their engines
        resp = await kmock.delete(kc.model_path("default", "tiny"))
        assert resp.status < 300

        async def stopped():
            gone = await kc.get(kmock, kc.model_path("default", "tiny")) is None
            return gone and not any(fleet.engine_pids(BASE_PORT + offsets[n]) for n in nodes if n != lost)
        await kc.wait_for(stopped, 60, "the model to go and its engines to stop", step=0.3)
        assert await _slice_endpoints(kmock) == []
    finally:
        await fleet.astop([*agents.values(), operator])
    assert operator.returncode == 0, (tmp_path / "operator.log").read_text()[-4000:]
    log = (tmp_path / "operator.log").read_text()
    assert "Traceback" not in log, log[-4000:]
