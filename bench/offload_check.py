"""The exactness check of ``bench/gpu_offload.py --check``: the decode paths of
``offload_decode.py`` against each other on the GPU, from the same input and routing."""
from __future__ import annotations

import torch

from offload_decode import decode_row
from offload_workload import Bank


def check_cpu_branch(bank: Bank, slots: int, bw: dict, cpu_fn) -> dict:
    """Exactness of the decode paths on the GPU, from the same x[0] and routing: with every miss
    filled, the per-layer driver (lru+sync) and the one-graph handshake (lru+q*@1) must equal the
    fills-only graph (lru) bit for bit; with q*, the handshake (lru+q*) must equal the per-layer
    driver (lru+q*/layer) bit for bit (same splits, same CPU kernel, same combine), and after the
    first layer the fills-only decode within 2e-2 (the CPU's and the GPU's bf16 rounding of the
    same experts). Through later layers that difference grows (random weights, no residual: a
    chaotic map), so the deviation per layer is reported, not bounded. The split by stage
    (lru+q*+st: the GPU's down projection of host activations) is held to the same 2e-2 against
    the fills-only decode after the first layer. The static split run by the one-graph handshake
    (static/graph) against the per-layer static driver (static): equal, or within 2e-2 after the
    first layer where they differ (the same experts on the same devices; only the combine may
    round differently). Raises RuntimeError."""
    from offload_workload import make_routing
    ids = make_routing(bank.model, 6, 1, "uniform", {}, seed=7)
    x = {}
    for policy in ("lru", "lru+sync", "lru+q*@1", "lru+q*", "lru+q*/layer", "lru+q*+st", "static", "static/graph"):
        torch.manual_seed(11)                              # the same x[0] for every policy
        x[policy] = decode_row(bank, policy, slots, ids, 3, bw, cpu_fn, keep_x=True)["x_layers"]
    per_layer = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(x["lru+q*"][1:], x["lru"][1:])]
    rel = per_layer[0]
    stage = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(x["lru+q*+st"][1:], x["lru"][1:])]
    static = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(x["static/graph"][1:], x["static"][1:])]
    first = next((d for d in static if d > 0), 0.0)           # the first layer where the two differ
    out = {"lru+sync_equals_lru": bool(torch.equal(x["lru"], x["lru+sync"])),
           "handshake_fills_only_equals_lru": bool(torch.equal(x["lru"], x["lru+q*@1"])),
           "handshake_equals_per_layer_driver": bool(torch.equal(x["lru+q*"], x["lru+q*/layer"])),
           "lru+q*_max_rel_diff_layer1": rel, "lru+q*_max_rel_diff_per_layer": per_layer,
           "lru+q*+st_max_rel_diff_layer1": stage[0], "lru+q*+st_max_rel_diff_per_layer": stage,
           "static/graph_equals_static": bool(torch.equal(x["static"], x["static/graph"])),
           "static/graph_max_rel_diff_per_layer": static}
    if not all(v for key, v in out.items() if key.endswith(("lru", "driver"))) or not max(rel, stage[0], first) < 2e-2:
        raise RuntimeError(f"CPU-branch decode differs from the fills-only decode: {out}")
    return out
