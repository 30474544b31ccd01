"""The placement planner: a pure function from observed state to desired placements.

``plan(models, nodes, previous)`` never performs I/O and never reads a clock; the same inputs
always give the same ``Plan``. Rules, in order:

1. A node is *healthy* when its heartbeat age is at most ``stale_seconds``. Replicas on nodes that
   are gone, stale, or no longer match the model's placement rules are removed.
2. Stability: a replica on a healthy matching node is kept (ready ones first when scaling down),
   even if a faster node has appeared. Models are served in (priority desc, key) order and kept
   replicas are counted before anything new is placed, so a new model never displaces an old one.
3. Memory pressure: the agent shrinks the expert cache first; a node still reporting pressure
   loses one replica (the lowest-priority one that fits elsewhere), and no other until the agent
   has stopped that one and still reports pressure: never all at once.
4. New replicas go to healthy, unpressured, matching nodes where the model fits: device memory
   (non-expert weights + minimum expert cache + KV, summed over the node's models, within VRAM
   minus foreign use, or host RAM in cpu mode), host RAM for the expert bank, and a free port.
   Preference: nodes that already hold the weights (ran this model, or stored its source.url
   file, matched by sha256), then Spread (fewest replicas)
   or Binpack (least free memory), then measured PCIe then CPU-expert bandwidth, then name.
5. A model short of replicas gets an ``unsatisfied`` reason in kube-scheduler style; so does a
   model whose source the node agents cannot load (a PVC, ``ModelView.unsupported``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from .observe import ModelView, NodeView


@dataclasses.dataclass(frozen=True)
class Placement:
    node: str
    port: int


@dataclasses.dataclass(frozen=True)
class Decision:
    """One change the plan makes; ``action`` is "place" or "remove"."""

    model: str
    node: str
    action: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Plan:
    placements: Mapping[str, tuple[Placement, ...]]   # model key -> replicas, sorted by node
    decisions: tuple[Decision, ...]
    unsatisfied: Mapping[str, str]                      # model key -> why it is short of replicas


class _Ledger:
    """Per-node running totals while planning."""

    def __init__(self, nodes: Iterable[NodeView]) -> None:
        self.used: dict[str, int] = collections.defaultdict(int)
        self.host: dict[str, int] = collections.defaultdict(int)
        self.ports: dict[str, set[int]] = collections.defaultdict(set)
        self.count: dict[str, int] = collections.defaultdict(int)
        self.nodes = {n.name: n for n in nodes}

    def add(self, model: ModelView, node: str, port: int) -> None:
        self.used[node] += model.need_bytes
        self.host[node] += model.host_bytes
        self.ports[node].add(port)
        self.count[node] += 1

    def remove(self, model: ModelView, node: str, port: int) -> None:
        self.used[node] -= model.need_bytes
        self.host[node] -= model.host_bytes
        self.ports[node].discard(port)
        self.count[node] -= 1

    def free(self, node: str) -> int:
        return self.nodes[node].capacity_bytes - self.used[node]


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}Gi"


def static_mismatch(model: ModelView, node: NodeView) -> str | None:
    """Why ``node`` can never run ``model`` as labelled and measured now, or None."""
    if model.device == "gpu" and node.mode != "gpu":
        return "node is cpu-only"
    if model.device == "cpu" and node.mode != "cpu":
        return "node is not in cpu mode"
    labels = dict(node.labels)
    if any(labels.get(k) != v for k, v in model.node_selector):
        return "node selector does not match"
    for taint in node.taints:
        t = dict(taint)
        if t.get("effect") in ("NoSchedule", "NoExecute") and not any(x.tolerates(t) for x in model.tolerations):
            return f"untolerated taint {t.get('key')}"
    if node.vram_total_bytes < model.min_vram_bytes:
        return f"VRAM below minimum {_gib(model.min_vram_bytes)}"
    if (node.pcie_gbps or 0.0) < model.min_pcie_gbps:
        return f"PCIe bandwidth below minimum {model.min_pcie_gbps:g} GB/s"
    return None


def _health(node: NodeView | None, stale_seconds: float) -> str | None:
    if node is None:
        return "node is gone"
    if node.heartbeat_age_s is None:
        return "no heartbeat yet"
    if node.heartbeat_age_s > stale_seconds:
        return f"heartbeat stale ({node.heartbeat_age_s:.0f}s > {stale_seconds:g}s)"
    return None


def _port(model: ModelView, node: str, ledger: _Ledger, base_port: int) -> int | None:
    taken = ledger.ports[node]
    if model.port is not None:
        return None if model.port in taken else model.port
    port = base_port
    while port in taken:
        port += 1
    return port if port <= 65535 else None


def _why_not(model: ModelView, node: NodeView, ledger: _Ledger, stale: float, base_port: int) -> str | None:
    """None when ``model`` can be placed on ``node`` now, else the reason it cannot."""
    reason = _health(node, stale) or static_mismatch(model, node)
    if reason:
        return reason
    if node.memory_pressure:
        return "node under memory pressure"
    if model.need_bytes > ledger.free(node.name):
        return f"insufficient memory (need {_gib(model.need_bytes)}, free {_gib(max(0, ledger.free(node.name)))})"
    if node.ram_total_bytes and model.host_bytes + ledger.host[node.name] > node.ram_total_bytes:
        return "insufficient host RAM for the expert bank"
    if _port(model, node.name, ledger, base_port) is None:
        return f"port {model.port} in use"
    return None


def _draining(node: NodeView, previous: Mapping[str, Mapping[str, int]]) -> bool:
    """True while the agent still runs a replica that is no longer in the node's spec."""
    assigned = {key for key, where in previous.items() if node.name in where}
    return any(key not in assigned and r.state in ("starting", "ready") for key, r in node.replicas.items())


def _score(model: ModelView, node: NodeView, ledger: _Ledger) -> tuple:
    local = 0 if node.holds(model) else 1
    load = ledger.count[node.name] if model.strategy == "Spread" else ledger.free(node.name) - model.need_bytes
    return (local, load, -(node.pcie_gbps or 0.0), -(node.cpu_expert_gbps or 0.0), node.name)


def plan(models: Sequence[ModelView], nodes: Sequence[NodeView],
         previous: Mapping[str, Mapping[str, int]], *,
         stale_seconds: float = 30.0, base_port: int = 1919) -> Plan:
    """Desired placements for every live model; see the module docstring for the rules."""
    by_name = {n.name: n for n in nodes}
    ledger = _Ledger(nodes)
    live = sorted((m for m in models if not m.deleting), key=lambda m: (-m.priority, m.key))
    unsatisfied: dict[str, str] = {}
    kept: dict[str, dict[str, int]] = {m.key: {} for m in live}
    decisions: list[Decision] = []
    live_keys = {m.key for m in live}
    for key, where in sorted(previous.items()):
        if key not in live_keys:
            decisions += [Decision(key, n, "remove", "model deleted") for n in sorted(where)]

    # 1-2. keep what still stands; ready replicas first when scaling down
    for model in live:
        prev = previous.get(model.key, {})
        ready_first = sorted(prev, key=lambda n: (
            not (n in by_name and by_name[n].replicas.get(model.key, None) is not None
                 and by_name[n].replicas[model.key].state == "ready"), n))
        for name in ready_first:
            node = by_name.get(name)
            reason = _health(node, stale_seconds) or (static_mismatch(model, node) if node else None)
            if reason is None and len(kept[model.key]) >= model.replicas:
                reason = "scaled down"
            if reason:
                decisions.append(Decision(model.key, name, "remove", reason))
                continue
            kept[model.key][name] = prev[name]
            ledger.add(model, name, prev[name])

    # 3. one replica off each pressured node, when another node can take it; none while the node
    #    still runs a replica already taken off it (its memory is not freed yet)
    for node in sorted(nodes, key=lambda n: n.name):
        if not node.memory_pressure or _health(node, stale_seconds) or _draining(node, previous):
            continue
        for model in reversed(live):
            if node.name not in kept[model.key]:
                continue
            port = kept[model.key].pop(node.name)
            ledger.remove(model, node.name, port)
            elsewhere = [n for n in nodes if n.name not in kept[model.key] and n.name != node.name
                         and _why_not(model, n, ledger, stale_seconds, base_port) is None]
            if elsewhere:   # move it now, so no later placement can take the target's room
                target = min(elsewhere, key=lambda n: _score(model, n, ledger))
                new_port = _port(model, target.name, ledger, base_port)
                if new_port is not None:
                    decisions += [Decision(model.key, node.name, "remove", "memory pressure on the node"),
                                  Decision(model.key, target.name, "place", f"moved off pressured {node.name}")]
                    kept[model.key][target.name] = new_port
                    ledger.add(model, target.name, new_port)
                    break
            kept[model.key][node.name] = port
            ledger.add(model, node.name, port)

    # 4-5. place what is missing
    for model in live:
        mine = kept[model.key]
        if model.unsupported:
            unsatisfied[model.key] = f"{len(mine)}/{model.replicas} replicas placed; {model.unsupported}"
            continue
        rejected: collections.Counter[str] = collections.Counter()
        while len(mine) < model.replicas:
            fits = []
            rejected.clear()
            for node in nodes:
                if node.name in mine:
                    continue
                why = _why_not(model, node, ledger, stale_seconds, base_port)
                if why is None:
                    fits.append(node)
                else:
                    rejected[why.split(" (")[0]] += 1
            if not fits:
                break
            best = min(fits, key=lambda n: _score(model, n, ledger))
            port = _port(model, best.name, ledger, base_port)
            if port is None:   # unreachable: _why_not rejected nodes without a free port
                break
            mine[best.name] = port
            ledger.add(model, best.name, port)
            local = " (weights already there)" if best.holds(model) else ""
            link = (f"PCIe {best.pcie_gbps:g} GB/s" if best.pcie_gbps is not None
                    else f"cpu mode, CPU experts {best.cpu_expert_gbps or 0:g} GB/s")
            decisions.append(Decision(model.key, best.name, "place", f"{model.strategy.lower()}, {link}{local}"))
        if len(mine) < model.replicas:
            why = ", ".join(f"{n} {r}" for r, n in sorted(rejected.items())) or "no FreeTokenNodes"
            unsatisfied[model.key] = (f"{len(mine)}/{model.replicas} replicas placed; "
                                      f"{len(nodes) - len(mine)} other node(s) unavailable: {why}")
    placements = {k: tuple(Placement(n, p) for n, p in sorted(v.items())) for k, v in kept.items()}
    return Plan(placements=placements, decisions=tuple(decisions), unsatisfied=unsatisfied)
