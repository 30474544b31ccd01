"""The agent's only contact with the Kubernetes API: its own cluster-scoped ``FreeTokenNode``.

* ``ensure_node()`` creates ``FreeTokenNode/<node>`` with an empty ``spec.models`` if missing.
* ``read_spec()`` returns the node's ``spec`` (the operator writes it).
* ``patch_status(status)`` merge-patches ``/status`` (CRDs accept no strategic merge).
* ``read_secret(ns, name, key)`` reads an API key for ``apiKeySecret``.

Calls use the official ``kubernetes`` client, which is synchronous: every public method here
is a coroutine that runs the call in a worker thread, so the agent's event loop (and a kmock
server sharing it in tests) never blocks. API errors surface as ``KubeError``.
"""

from __future__ import annotations

import asyncio
import base64

GROUP, VERSION, PLURAL = "freetoken.io", "v1alpha1", "freetokennodes"
MERGE_PATCH = "application/merge-patch+json"


class KubeError(RuntimeError):
    """A Kubernetes API call failed (status code in ``.status``, 0 for transport errors)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def _api_client(server: str | None):
    from kubernetes import client, config

    if server:  # plain HTTP to a given server (tests: kmock)
        cfg = client.Configuration()
        cfg.host = server.rstrip("/")
        return client.ApiClient(cfg)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class NodeReporter:
    def __init__(self, node_name: str, server: str | None = None) -> None:
        from kubernetes import client

        self.node_name = node_name
        self._api = _api_client(server)
        self._custom = client.CustomObjectsApi(self._api)
        self._core = client.CoreV1Api(self._api)

    async def _call(self, fn, *args, **kwargs):
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ApiException as exc:
            raise KubeError(f"{fn.__name__}: {exc.status} {exc.reason}", exc.status) from exc
        except (HTTPError, OSError) as exc:  # connection refused, timeouts, retries exhausted
            raise KubeError(f"{fn.__name__}: {exc}") from exc

    async def get_node(self) -> dict | None:
        try:
            return await self._call(self._custom.get_cluster_custom_object,
                                    GROUP, VERSION, PLURAL, self.node_name)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def ensure_node(self) -> dict:
        """Return the node object, creating it (``spec.models: []``) when missing."""
        obj = await self.get_node()
        if obj is not None:
            return obj
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "FreeTokenNode",
                "metadata": {"name": self.node_name}, "spec": {"models": []}}
        try:
            created = await self._call(self._custom.create_cluster_custom_object,
                                       GROUP, VERSION, PLURAL, body)
            return created or body
        except KubeError as exc:
            if exc.status == 409:  # created meanwhile (by the operator)
                return await self.get_node() or body
            raise

    async def read_spec(self) -> dict:
        obj = await self.get_node()
        if obj is None:
            obj = await self.ensure_node()
        spec = obj.get("spec") or {}
        return spec if isinstance(spec, dict) else {}

    async def patch_status(self, status: dict) -> None:
        await self._call(self._custom.patch_cluster_custom_object_status,
                         GROUP, VERSION, PLURAL, self.node_name, {"status": status},
                         _content_type=MERGE_PATCH)

    async def read_secret(self, namespace: str, name: str, key: str) -> str:
        secret = await self._call(self._core.read_namespaced_secret, name, namespace)
        data = (secret.data or {}).get(key)
        if data is None:
            raise KubeError(f"secret {namespace}/{name} has no key {key!r}", 404)
        return base64.b64decode(data).decode()

    def close(self) -> None:
        self._api.close()
