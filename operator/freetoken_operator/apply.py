"""Apply: the only module that writes to the Kubernetes API.

``Applier.apply(state, observed_nodes, observed_models)`` makes the cluster match a DesiredState,
writing only what differs: FreeTokenNode ``spec.models`` (merge patch, the list is replaced whole),
FreeTokenModel ``status`` (merge patch to the status subresource), one selector-less Service per
model, its EndpointSlices (created, patched, deleted by deterministic name), core/v1 Events and
the API-key Secrets it generates (created once, never read).
Only create, patch and delete are used (no PUT), and label selectors are filtered client-side
too, so it also runs against API emulators that lack those (kmock).

Blocking (the official ``kubernetes`` client); the reconciler runs it in a worker thread. Every
call carries a timeout (connect and read), so a connection that never answers fails the pass
instead of holding the thread for good. It returns the bodies it wrote so the caller can update
its Store. Raises ``ApiException`` for errors it cannot absorb (404 on a vanished object and 409
on a racing create are absorbed), and urllib3's errors for a timeout or a refused connection.
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import secrets
import time
import uuid
from collections.abc import Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from .objects import GENERATED_KEY
from .resources import GROUP, LABEL_MANAGED_BY, LABEL_MODEL, MANAGED_BY, MODELS, NODES, VERSION
from .status import DesiredState, Event, rfc3339

log = logging.getLogger(__name__)

# The official client picks application/json-patch+json for built-in kinds when no type is given,
# which a real API server rejects for a dict body; every patch here is an RFC 7386 merge patch.
MERGE = "application/merge-patch+json"


def _same(old: Any, new: Any) -> bool:
    """True when every key of ``new`` already has that value in ``old`` (recursively)."""
    if isinstance(new, Mapping):
        return isinstance(old, Mapping) and all(_same(old.get(k), v) for k, v in new.items())
    return old == new


class _Timed:
    """An official-client API object whose every call gets ``_request_timeout``."""

    def __init__(self, api: Any, timeout: float) -> None:
        self._api, self._timeout = api, timeout

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._api, name)
        return lambda *args, **kwargs: fn(*args, _request_timeout=self._timeout, **kwargs)


class Applier:
    """Writes DesiredStates. Services and EndpointSlices are not watched: what was last written
    is remembered and forgotten every ``refresh_seconds``, so objects someone else changed or
    deleted are repaired within that time."""

    def __init__(self, api: client.ApiClient, refresh_seconds: float = 60.0, timeout: float = 30.0) -> None:
        self.custom = _Timed(client.CustomObjectsApi(api), timeout)
        self.core = _Timed(client.CoreV1Api(api), timeout)
        self.discovery = _Timed(client.DiscoveryV1Api(api), timeout)
        self.refresh_seconds = refresh_seconds
        self._refreshed = time.monotonic()
        self.services: dict[tuple[str, str], dict[str, Any]] = {}     # last written, by (ns, name)
        self.slices: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}  # (ns, model) -> name -> body
        self.secrets: set[tuple[str, str, str]] = set()   # generated key Secrets known to exist, (ns, name, owner uid)

    def apply(self, state: DesiredState, nodes: Mapping[str, Mapping[str, Any]],
              models: Mapping[tuple[str, str], Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        """Write the differences; returns {"nodes": [...], "models": [...]} bodies as written."""
        written: dict[str, list[dict[str, Any]]] = {"nodes": [], "models": []}
        if time.monotonic() - self._refreshed > self.refresh_seconds:
            self.services.clear()
            self.slices.clear()
            self.secrets.clear()
            self._refreshed = time.monotonic()
        # the generated API-key Secrets before the node specs that name them, so an agent
        # starting the engine finds its key
        for secret in state.secrets:
            self._key_secret(secret)
        for name, entries in sorted(state.node_specs.items()):
            current = (nodes.get(name, {}).get("spec") or {}).get("models") or []
            if current != entries:
                body = self._ignore_404(self.custom.patch_cluster_custom_object, GROUP, VERSION, NODES, name,
                                        {"spec": {"models": entries}}, _content_type=MERGE)
                if body:
                    written["nodes"].append(body)
        # Services and EndpointSlices before the status: a client that waits for Ready (kubectl
        # wait, a coding agent's launcher) then finds the endpoints it reports already routable.
        for svc in state.services:
            self._service(svc)
        for ref, wanted in sorted(state.slices.items()):
            self._slices(ref, wanted)
        for (ns, name), status in sorted(state.model_status.items()):
            if not _same(models.get((ns, name), {}).get("status") or {}, status):
                body = self._ignore_404(self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, ns,
                                        MODELS, name, {"status": status}, _content_type=MERGE)
                if body:
                    written["models"].append(body)
        for event in state.events:
            self._event(event)
        return written

    def forget_model(self, namespace: str, name: str) -> None:
        """Delete the model's Service and EndpointSlices (deletion through the finalizer)."""
        self._slices((namespace, name), [])
        self._ignore_404(self.core.delete_namespaced_service, name, namespace)
        self.services.pop((namespace, name), None)
        self.slices.pop((namespace, name), None)

    # -- owned objects -------------------------------------------------------------------------
    def _service(self, svc: dict[str, Any]) -> None:
        meta = svc["metadata"]
        ref = (meta["namespace"], meta["name"])
        if ref in self.services and _same(self.services[ref], svc):
            return
        try:
            self.core.create_namespaced_service(ref[0], svc)
        except ApiException as exc:
            if exc.status != 409:
                raise
            self.core.patch_namespaced_service(ref[1], ref[0], {"metadata": {"labels": meta["labels"]},
                                                                 "spec": {"ports": svc["spec"]["ports"]}},
                                               _content_type=MERGE)
        self.services[ref] = svc

    def _key_secret(self, secret: dict[str, Any]) -> None:
        """Create a generated API-key Secret with a random key unless it exists. Only ``create``:
        an existing Secret (generated earlier, or the user's own of that name) is never read or
        rewritten, so the operator needs no read access to Secrets."""
        meta = secret["metadata"]
        ref = (meta["namespace"], meta["name"])
        owner = meta["ownerReferences"][0]["uid"]   # a model made again under its old name: a new Secret
        if (*ref, owner) in self.secrets:
            return
        token = base64.b64encode(secrets.token_urlsafe(32).encode()).decode()
        try:
            self.core.create_namespaced_secret(ref[0], {**secret, "data": {GENERATED_KEY: token}})
            log.info("generated the API key Secret %s/%s", *ref)
        except ApiException as exc:
            if exc.status == 403:   # no create right in that namespace (chart: agent.secretNamespaces)
                log.warning("cannot create the API key Secret %s/%s (forbidden): name an existing one in "
                            "serving.apiKeySecret or allow the namespace", *ref)
                self.secrets.add((*ref, owner))   # tried again after refresh_seconds, not on every pass
                return
            if exc.status != 409:
                raise
        self.secrets.add((*ref, owner))

    def _existing_slices(self, ns: str, model: str) -> dict[str, dict[str, Any]]:
        listed = self.discovery.list_namespaced_endpoint_slice(ns, label_selector=f"{LABEL_MODEL}={model}")
        out = {}
        for item in listed.items:   # filtered again here: some API emulators ignore selectors
            labels = item.metadata.labels or {}
            if labels.get(LABEL_MODEL) == model and labels.get(LABEL_MANAGED_BY) == MANAGED_BY:
                out[item.metadata.name] = {}
        return out

    def _slices(self, ref: tuple[str, str], wanted: list[dict[str, Any]]) -> None:
        if ref not in self.slices:
            self.slices[ref] = self._existing_slices(*ref)
        have = self.slices[ref]
        want = {s["metadata"]["name"]: s for s in wanted}
        for name in sorted(set(have) - set(want)):
            self._ignore_404(self.discovery.delete_namespaced_endpoint_slice, name, ref[0])
            del have[name]
        for name, body in sorted(want.items()):
            if name in have and _same(have[name], body):
                continue
            try:
                self.discovery.create_namespaced_endpoint_slice(ref[0], body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self.discovery.patch_namespaced_endpoint_slice(name, ref[0], {"endpoints": body["endpoints"],
                                                                              "ports": body["ports"]},
                                                               _content_type=MERGE)
            have[name] = body

    def _event(self, e: Event, now: dt.datetime | None = None) -> None:
        stamp = rfc3339(now or dt.datetime.now(dt.timezone.utc))
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{e.name}.{uuid.uuid4().hex[:12]}", "namespace": e.namespace},
            "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": "FreeTokenModel",
                               "name": e.name, "namespace": e.namespace, "uid": e.uid},
            "reason": e.reason, "message": e.message[:1024], "type": e.type,
            "source": {"component": MANAGED_BY}, "reportingComponent": MANAGED_BY,
            "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }
        try:
            self.core.create_namespaced_event(e.namespace, body)
        except ApiException as exc:   # events are best effort; never fail a reconcile for one
            log.warning("event %s/%s not posted: %s", e.namespace, e.reason, exc.status)

    @staticmethod
    def _ignore_404(fn, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise


def api_client(server: str | None) -> client.ApiClient:
    """An official-client ApiClient: plain ``server`` URL if given, else in-cluster, else kubeconfig."""
    from kubernetes import config as kube_config

    conf = client.Configuration()
    if server:
        conf.host = server
    else:
        try:
            kube_config.load_incluster_config(client_configuration=conf)
        except kube_config.ConfigException:
            kube_config.load_kube_config(client_configuration=conf)
    return client.ApiClient(conf)
