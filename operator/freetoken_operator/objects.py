"""Builders for the objects the operator owns: FreeTokenNode spec entries, Services, EndpointSlices
and generated API-key Secrets.

Pure functions of their arguments. Contract for the FreeTokenNode entry: docs/contracts.md.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

from .resources import (GROUP, LABEL_MANAGED_BY, LABEL_MODEL, MANAGED_BY, MODEL_KIND,
                        SERVICE_NAME_LABEL, SLICE_MANAGED_BY_LABEL, VERSION, model_key)

DEFAULT_SERVICE_PORT = 80
GENERATED_KEY = "api-key"        # the data key of a Secret the operator generates


def node_entry(model: Mapping[str, Any], port: int, node_mode: str) -> dict[str, Any]:
    """One ``FreeTokenNode.spec.models[]`` item for ``model`` on a node in ``node_mode``."""
    meta, spec = model["metadata"], model.get("spec") or {}
    source = dict(spec.get("source") or {"default": True})
    engine_in = spec.get("engine") or {}
    gpu = node_mode == "gpu"
    engine: dict[str, Any] = {
        "device": engine_in.get("device", "cuda" if gpu else "cpu"),
        "dtype": engine_in.get("dtype", "bfloat16" if gpu else "float32"),
        "expertCacheShare": engine_in.get("expertCacheShare", 0.9),
    }
    if "contextLength" in engine_in:
        engine["contextLength"] = engine_in["contextLength"]
    if engine_in.get("features"):
        engine["features"] = dict(engine_in["features"])      # unchanged: the agent reads what it knows
    entry: dict[str, Any] = {
        "key": model_key(meta.get("namespace", "default"), meta["name"]),
        "namespace": meta.get("namespace", "default"),
        "model": meta["name"],
        "source": source,
        "format": spec.get("format") or ("default" if source.get("default") else "safetensors"),
        "port": port,
        "engine": engine,
    }
    ref = api_key_ref(model)
    if ref:
        entry["apiKeySecret"] = ref
    return entry


def api_key_ref(model: Mapping[str, Any]) -> dict[str, str] | None:
    """The Secret holding ``model``'s API key, ``{"name", "key"}``: ``serving.apiKeySecret``, or,
    when none is named, the one the operator generates (``generated_key_secret``); None only
    with ``serving.auth: none`` (engines serve without a key)."""
    mode, secret = _key_source(model)
    if mode == "own":
        return {"name": secret["name"], "key": secret.get("key", GENERATED_KEY)}
    if mode == "generated":
        return {"name": generated_secret_name(model["metadata"]["name"]), "key": GENERATED_KEY}
    return None


def _key_source(model: Mapping[str, Any]) -> tuple[str, Mapping[str, Any] | None]:
    """("none" | "own" | "generated", the named Secret or None)."""
    serving = (model.get("spec") or {}).get("serving") or {}
    if serving.get("auth", "apiKey") == "none":
        return "none", None
    secret = serving.get("apiKeySecret")
    return ("own", secret) if secret else ("generated", None)


def generated_secret_name(model_name: str) -> str:
    return f"{model_name}-api-key"


def generated_key_secret(model: Mapping[str, Any]) -> dict[str, Any] | None:
    """The Secret the operator creates for a model that asks for a key but names no Secret
    (without its value: the applier adds a random one when it creates it, and never rewrites
    it); None when the model names its own Secret or serves without a key. Owned by the
    model, so deleting the model deletes it."""
    if _key_source(model)[0] != "generated":
        return None
    meta = model["metadata"]
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": generated_secret_name(meta["name"]), "namespace": meta.get("namespace", "default"),
                     "labels": _labels(meta["name"]), "ownerReferences": [owner_reference(model)]},
    }


def owner_reference(model: Mapping[str, Any]) -> dict[str, Any]:
    meta = model["metadata"]
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": MODEL_KIND, "name": meta["name"],
            "uid": meta.get("uid") or "", "controller": True, "blockOwnerDeletion": True}


def _labels(model_name: str) -> dict[str, str]:
    return {LABEL_MODEL: model_name, LABEL_MANAGED_BY: MANAGED_BY}


def service(model: Mapping[str, Any]) -> dict[str, Any]:
    """A ClusterIP Service without selector; its endpoints come from our EndpointSlices."""
    meta = model["metadata"]
    port = (model.get("spec", {}).get("serving") or {}).get("servicePort", DEFAULT_SERVICE_PORT)
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": meta["name"], "namespace": meta.get("namespace", "default"),
                     "labels": _labels(meta["name"]), "ownerReferences": [owner_reference(model)]},
        "spec": {"type": "ClusterIP", "ports": [{"name": "http", "port": port, "protocol": "TCP"}]},
    }


def _address_type(host: str) -> str:
    try:
        return "IPv6" if ipaddress.ip_address(host).version == 6 else "IPv4"
    except ValueError:
        return "FQDN"


def endpoint_slices(model: Mapping[str, Any], ready: Iterable[tuple[str, str]]) -> list[dict[str, Any]]:
    """EndpointSlices listing ``ready`` (node name, endpoint URL) pairs of ``model``.

    One slice per (address type, port): a slice's ports apply to all its endpoints, and replicas
    on different nodes may listen on different ports. Names are deterministic, so apply can diff.
    """
    meta = model["metadata"]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for node, url in sorted(ready):
        parsed = urllib.parse.urlsplit(url)
        if not parsed.hostname or not parsed.port:
            continue
        kind = _address_type(parsed.hostname)
        groups.setdefault((kind, parsed.port), []).append(
            {"addresses": [parsed.hostname], "conditions": {"ready": True}, "nodeName": node})
    labels = {**_labels(meta["name"]), SERVICE_NAME_LABEL: meta["name"], SLICE_MANAGED_BY_LABEL: MANAGED_BY}
    return [{
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{meta['name']}-{kind.lower()}-{port}", "namespace": meta.get("namespace", "default"),
                     "labels": labels, "ownerReferences": [owner_reference(model)]},
        "addressType": kind,
        "endpoints": eps,
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    } for (kind, port), eps in sorted(groups.items())]
