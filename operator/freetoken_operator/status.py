"""From a Plan and the observed objects to the complete desired state (pure; apply writes it).

Model status: ``phase`` (Pending | Starting | Ready | Degraded | Idle), ``replicas``,
``readyReplicas``, ``ready`` ("1/2"), ``nodes`` ("n1,n2"), ``endpoints`` (URLs of ready replicas),
``placements`` and four ``metav1.Condition``-shaped conditions:

- Scheduled: every desired replica has a node (False with the planner's reason otherwise);
- Ready: at least one replica is serving (the model answers);
- Degraded: fewer replicas serve than desired, or one failed;
- MemoryPressure: a node running the model reports memory pressure past the cache floor.

A condition's ``lastTransitionTime`` changes only when its status changes, so writing the same
state twice is a no-op for apply.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from . import objects
from .observe import NodeView
from .plan import Plan
from .resources import model_key


@dataclasses.dataclass(frozen=True)
class Event:
    namespace: str
    name: str
    uid: str
    type: str       # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class DesiredState:
    node_specs: Mapping[str, list[dict[str, Any]]]          # node -> spec.models
    model_status: Mapping[tuple[str, str], dict[str, Any]]  # (namespace, name) -> status
    services: Sequence[dict[str, Any]]
    slices: Mapping[tuple[str, str], list[dict[str, Any]]]  # (namespace, model) -> EndpointSlices
    events: Sequence[Event]
    secrets: Sequence[dict[str, Any]] = ()                  # generated API-key Secrets (no value yet)


def rfc3339(now: dt.datetime) -> str:
    return now.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(ctype: str, ok: bool, reason: str, message: str, old: Sequence[Mapping[str, Any]],
              now: dt.datetime, generation: int | None) -> dict[str, Any]:
    """A metav1.Condition; keeps the old lastTransitionTime when the status did not change."""
    status = "True" if ok else "False"
    prev = next((c for c in old if c.get("type") == ctype), None)
    since = prev["lastTransitionTime"] if prev and prev.get("status") == status and prev.get(
        "lastTransitionTime") else rfc3339(now)
    cond = {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _model_status(body: Mapping[str, Any], plan: Plan, nodes: Mapping[str, NodeView],
                  stale_seconds: float, now: dt.datetime) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    meta, spec = body["metadata"], body.get("spec") or {}
    key = model_key(meta.get("namespace", "default"), meta["name"])
    want = int(spec.get("replicas", 1))
    rows, ready, failed, pressured = [], [], [], []
    for p in plan.placements.get(key, ()):
        node = nodes.get(p.node)
        healthy = node is not None and node.heartbeat_age_s is not None and node.heartbeat_age_s <= stale_seconds
        rep = node.replicas.get(key) if node else None
        state = rep.state if (rep and healthy) else ("unknown" if not healthy else "pending")
        row = {"node": p.node, "port": p.port, "state": state, "endpoint": rep.endpoint if rep else None}
        if rep and healthy and rep.message and state != "ready":     # "fetching 1.20 of 61.00 GB from ..."
            row["message"] = rep.message[:1024]
        rows.append(row)
        if state == "ready" and rep and rep.endpoint:
            ready.append((p.node, rep.endpoint))
        if state == "failed":
            failed.append(f"{p.node}: {rep.message if rep else ''}".rstrip(": "))
        if node is not None and node.memory_pressure:
            pressured.append(p.node)
    placed, n_ready = len(rows), len(ready)
    if want == 0:
        phase = "Idle"
    elif n_ready >= want:
        phase = "Ready"
    elif n_ready > 0:
        phase = "Degraded"
    else:
        phase = "Starting" if placed else "Pending"
    old = (body.get("status") or {}).get("conditions") or []
    gen = meta.get("generation")
    why = plan.unsatisfied.get(key)
    degraded = n_ready < want or bool(failed)
    conditions = [
        condition("Scheduled", why is None, "Placed" if why is None else "Unschedulable",
                  why or f"{placed}/{want} replicas placed", old, now, gen),
        condition("Ready", n_ready > 0, "ReplicaReady" if n_ready else "NoReadyReplica",
                  f"{n_ready}/{want} replicas ready", old, now, gen),
        condition("Degraded", degraded, "ReplicaFailed" if failed else (
            "ReplicasUnavailable" if degraded else "AllReplicasReady"),
            "; ".join(failed) or f"{n_ready}/{want} replicas ready", old, now, gen),
        condition("MemoryPressure", bool(pressured), "NodeMemoryPressure" if pressured else "NoPressure",
                  ("under pressure: " + ",".join(pressured)) if pressured else "no node under pressure",
                  old, now, gen),
    ]
    key_ref = objects.api_key_ref(body)
    status = {"phase": phase, "replicas": want, "readyReplicas": n_ready, "ready": f"{n_ready}/{want}",
              "nodes": ",".join(r["node"] for r in rows), "endpoints": [u for _, u in ready],
              "placements": rows, "conditions": conditions,
              "apiKeySecret": key_ref["name"] if key_ref else None}
    if gen is not None:
        status["observedGeneration"] = gen
    return status, ready


_REMOVE_REASONS = {"heartbeat": ("Warning", "NodeLost"), "memory": ("Warning", "MemoryPressure"),
                   "node is gone": ("Warning", "NodeLost")}


def desired(models: Mapping[tuple[str, str], Mapping[str, Any]], node_views: Sequence[NodeView], plan: Plan,
            *, stale_seconds: float, now: dt.datetime) -> DesiredState:
    """Everything the cluster should say after ``plan``; ``models`` are the raw FreeTokenModel bodies."""
    nodes = {n.name: n for n in node_views}
    bodies = {model_key(ns, name): b for (ns, name), b in models.items()}
    node_specs: dict[str, list[dict[str, Any]]] = {n: [] for n in nodes}
    statuses, services, slices, events, secrets = {}, [], {}, [], []
    for (ns, name), body in sorted(models.items()):
        key = model_key(ns, name)
        for p in plan.placements.get(key, ()):
            if p.node in node_specs:
                node_specs[p.node].append(objects.node_entry(body, p.port, nodes[p.node].mode))
        if (body.get("metadata") or {}).get("deletionTimestamp"):
            continue
        status, ready = _model_status(body, plan, nodes, stale_seconds, now)
        statuses[(ns, name)] = status
        generated = objects.generated_key_secret(body)
        if generated is not None:
            secrets.append(generated)
        services.append(objects.service(body))
        slices[(ns, name)] = objects.endpoint_slices(body, ready)
        old = {c["type"]: c for c in (body.get("status") or {}).get("conditions") or ()}
        sched = status["conditions"][0]
        if sched["status"] == "False" and (old.get("Scheduled", {}).get("message") != sched["message"]):
            events.append(Event(ns, name, body["metadata"].get("uid", ""), "Warning", "Unschedulable",
                                sched["message"]))
    for d in plan.decisions:
        body = bodies.get(d.model)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            continue
        meta = body["metadata"]
        if d.action == "place":
            etype, reason, msg = "Normal", "Placed", f"replica placed on {d.node}: {d.reason}"
        else:
            etype, reason = next((v for k, v in _REMOVE_REASONS.items() if d.reason.startswith(k)),
                                 ("Normal", "Removed"))
            msg = f"replica removed from {d.node}: {d.reason}"
        events.append(Event(meta.get("namespace", "default"), meta["name"], meta.get("uid", ""), etype, reason, msg))
    return DesiredState(node_specs, statuses, services, slices, events, secrets)
