"""Observe: keep the last-seen API objects and turn them into the plan's typed views.

``Store`` is fed by watch events (handlers.py) and by apply's write responses; it is owned by one
asyncio loop and never locked. ``model_views``, ``node_views`` and ``previous_placements`` are
pure reads of it. Heartbeat age is measured on the operator's own clock (the time since the
heartbeat value last *changed*, as the kubelet's node-lifecycle controller does), so a skewed node
clock neither hides nor fakes a lost node; a heartbeat older than its first sighting counts too.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from .resources import model_key


@dataclasses.dataclass(frozen=True)
class Toleration:
    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, taint: Mapping[str, str]) -> bool:
        """Kubernetes toleration matching (empty key with Exists matches every taint)."""
        if self.effect and self.effect != taint.get("effect"):
            return False
        if self.operator == "Exists":
            return not self.key or self.key == taint.get("key")
        return self.key == taint.get("key") and self.value == taint.get("value", "")


@dataclasses.dataclass(frozen=True)
class ModelView:
    """What the planner needs of one FreeTokenModel (defaults as in the CRD)."""

    namespace: str
    name: str
    replicas: int = 1
    priority: int = 0
    need_bytes: int = 0          # device memory: non-expert weights + minimum expert cache + KV
    host_bytes: int = 0          # host RAM for the expert bank
    min_vram_bytes: int = 0
    min_pcie_gbps: float = 0.0
    device: str = "any"          # gpu | cpu | any: which node modes may run it
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Toleration, ...] = ()
    strategy: str = "Spread"     # Spread | Binpack
    port: int | None = None      # explicit engine port, else one is allocated per node
    deleting: bool = False
    unsupported: str | None = None   # why no node can run it whatever its resources, or None
    sha256: str | None = None        # source.sha256: a node whose agent stored that file holds the weights

    @property
    def key(self) -> str:
        return model_key(self.namespace, self.name)


@dataclasses.dataclass(frozen=True)
class ReplicaView:
    state: str
    endpoint: str | None = None
    message: str = ""


@dataclasses.dataclass(frozen=True)
class NodeView:
    """What the planner needs of one FreeTokenNode (status by the agent, labels/taints by k8s)."""

    name: str
    heartbeat_age_s: float | None = 0.0    # None: the agent never reported
    mode: str = "gpu"
    labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[tuple[tuple[str, str], ...], ...] = ()
    vram_total_bytes: int = 0
    vram_foreign_bytes: int = 0
    ram_total_bytes: int = 0
    pcie_gbps: float | None = None
    cpu_expert_gbps: float | None = None
    memory_pressure: bool = False
    replicas: Mapping[str, ReplicaView] = dataclasses.field(default_factory=dict, compare=False)
    stored_sha256: frozenset[str] = frozenset()     # source.url files in the agent's model store

    def holds(self, model: ModelView) -> bool:
        """The node runs the model, or its agent has the model's file (by sha256) in its store."""
        return model.key in self.replicas or (model.sha256 is not None and model.sha256 in self.stored_sha256)

    @property
    def capacity_bytes(self) -> int:
        """Memory our engines may use: VRAM minus foreign use, or host RAM in cpu mode."""
        if self.mode == "cpu":
            return self.ram_total_bytes
        return max(0, self.vram_total_bytes - self.vram_foreign_bytes)


def quantity(value: Any, default: int = 0) -> int:
    """Bytes from an int or a Kubernetes quantity string ("24Gi"); raises ValueError if bad."""
    if value is None:
        return default
    return int(parse_quantity(value))


def parse_time(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    try:
        parsed = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


def model_view(body: Mapping[str, Any]) -> ModelView:
    """Typed view of a FreeTokenModel body; raises ValueError for a spec the schema let through."""
    meta, spec = body.get("metadata", {}), body.get("spec", {}) or {}
    placement, memory = spec.get("placement", {}) or {}, spec.get("memory", {}) or {}
    need = sum(quantity(memory.get(k)) for k in ("nonExpert", "minExpertCache", "kvCache"))
    return ModelView(
        namespace=meta.get("namespace", "default"),
        name=meta["name"],
        replicas=int(spec.get("replicas", 1)),
        priority=int(spec.get("priority", 0)),
        need_bytes=need,
        host_bytes=quantity(memory.get("host")),
        min_vram_bytes=quantity(placement.get("minVram")),
        min_pcie_gbps=float(placement.get("minPcieGbps", 0.0)),
        device=placement.get("device", "any"),
        node_selector=tuple(sorted((placement.get("nodeSelector") or {}).items())),
        tolerations=tuple(Toleration(**{k: t[k] for k in ("key", "operator", "value", "effect") if k in t})
                          for t in placement.get("tolerations") or ()),
        strategy=placement.get("strategy", "Spread"),
        port=(spec.get("serving") or {}).get("port"),
        deleting=bool(meta.get("deletionTimestamp")),
        unsupported=_unsupported_source(spec.get("source") or {"default": True}),
        sha256=(spec.get("source") or {}).get("sha256"),
    )


# What node agents can load (docs/contracts.md): a url is downloaded into each node's model store.
# A PVC would need the agent's pod to mount it, which it does not.
AGENT_SOURCES = ("path", "url", "default")


def _unsupported_source(source: Mapping[str, Any]) -> str | None:
    kinds = [k for k in ("path", "pvc", "url") if k in source] + (["default"] if source.get("default") else [])
    bad = [k for k in kinds if k not in AGENT_SOURCES]
    return f"source.{bad[0]} is not supported by the node agents yet (use source.path or source.url)" if bad else None


class Store:
    """Last-seen bodies by watch events. Single-threaded (the operator's event loop)."""

    def __init__(self) -> None:
        self.models: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.k8s_nodes: dict[str, dict[str, Any]] = {}
        self._beats: dict[str, tuple[str | None, dt.datetime]] = {}   # name -> (heartbeat, seen at)

    def put_model(self, body: Mapping[str, Any], deleted: bool = False) -> None:
        meta = body["metadata"]
        ref = (meta.get("namespace", "default"), meta["name"])
        if deleted:
            self.models.pop(ref, None)
        else:
            self.models[ref] = dict(body)

    def put_node(self, body: Mapping[str, Any], deleted: bool = False, now: dt.datetime | None = None) -> None:
        name = body["metadata"]["name"]
        if deleted:
            self.nodes.pop(name, None)
            self._beats.pop(name, None)
            return
        self.nodes[name] = dict(body)
        now = now or dt.datetime.now(dt.timezone.utc)
        beat = (body.get("status") or {}).get("heartbeat")
        if name not in self._beats or self._beats[name][0] != beat:
            stamp = parse_time(beat)
            first = name not in self._beats
            # First sighting: trust an old stamp (operator restart after a node died), never a future one.
            seen = min(now, stamp) if (first and stamp is not None) else now
            self._beats[name] = (beat, seen)

    def put_k8s_node(self, body: Mapping[str, Any], deleted: bool = False) -> None:
        name = body["metadata"]["name"]
        if deleted:
            self.k8s_nodes.pop(name, None)
        else:
            self.k8s_nodes[name] = dict(body)

    def model_views(self) -> list[ModelView]:
        return [model_view(body) for body in self.models.values()]

    def node_views(self, now: dt.datetime | None = None) -> list[NodeView]:
        now = now or dt.datetime.now(dt.timezone.utc)
        return [self._node_view(name, body, now) for name, body in sorted(self.nodes.items())]

    def _node_view(self, name: str, body: Mapping[str, Any], now: dt.datetime) -> NodeView:
        status = body.get("status") or {}
        gpu = status.get("gpu") or {}
        k8s = self.k8s_nodes.get(name, {})
        labels = dict((body.get("metadata") or {}).get("labels") or {})
        labels.update((k8s.get("metadata") or {}).get("labels") or {})
        taints = tuple(tuple(sorted((k, str(v)) for k, v in t.items() if k in ("key", "value", "effect")))
                       for t in (k8s.get("spec") or {}).get("taints") or ())
        beat, seen = self._beats.get(name, (None, now))
        return NodeView(
            name=name,
            heartbeat_age_s=None if beat is None else max(0.0, (now - seen).total_seconds()),
            mode=status.get("mode", "gpu"),
            labels=tuple(sorted(labels.items())),
            taints=taints,
            vram_total_bytes=int(gpu.get("vramTotalBytes") or 0),
            vram_foreign_bytes=int(gpu.get("vramForeignBytes") or 0),
            ram_total_bytes=int(status.get("ramTotalBytes") or 0),
            pcie_gbps=status.get("pcieGbps"),
            cpu_expert_gbps=status.get("cpuExpertGbps"),
            memory_pressure=bool(status.get("memoryPressure")),
            replicas={r["key"]: ReplicaView(r.get("state", "starting"), r.get("endpoint"), r.get("message") or "")
                      for r in status.get("replicas") or () if "key" in r},
            stored_sha256=frozenset(status.get("storedSha256") or ()),
        )

    def previous_placements(self) -> dict[str, dict[str, int]]:
        """What the operator last wrote: model key -> {node name: port}, from FreeTokenNode specs."""
        out: dict[str, dict[str, int]] = {}
        for name, body in self.nodes.items():
            for entry in (body.get("spec") or {}).get("models") or ():
                if "key" in entry and "port" in entry:
                    out.setdefault(entry["key"], {})[name] = int(entry["port"])
        return out
