"""Workload of ``bench/gpu_offload.py``: the engine import shim, model shapes, the pinned bank and
the routing models (uniform, and locality from the default model's measured statistics)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "engine"))


def _engine_package() -> None:
    """Import the engine package; where its __init__ cannot load here (it pulls the whole
    engine: tokenizers, models), register the bare package so cache/ and kernels/ still import."""
    try:
        import freetoken_engine  # noqa: F401
    except ImportError as exc:
        import types
        pkg = types.ModuleType("freetoken_engine")
        pkg.__path__ = [str(ROOT / "engine/freetoken_engine")]
        sys.modules["freetoken_engine"] = pkg
        print(f"note: freetoken_engine/__init__ not importable here ({exc}); loading its submodules only")


_engine_package()
from freetoken_engine.cache.bank import ExpertBank  # noqa: E402  (after the shim above)

CUDA = torch.device("cuda")


# ---------------------------------------------------------------------------------------------
# Models, bank, routing
# ---------------------------------------------------------------------------------------------
def _model(layers, experts, top_k, hidden, inter, shared_inter, non_expert_bytes):
    return {"layers": layers, "experts": experts, "top_k": top_k, "hidden": hidden, "inter": inter,
            "shared_inter": shared_inter, "non_expert_bytes": non_expert_bytes,
            "expert_bytes": 3 * hidden * inter * 2}


MODELS = {   # shapes and non-expert bytes: ../shared/LIMITS.md (verified on the meta device)
    "qwen3-30b-a3b": _model(48, 128, 8, 2048, 768, 0, 2.46e9),
    "qwen3.6-35b-a3b": _model(40, 256, 8, 2048, 512, 512, 3.9e9),
}


class Bank(ExpertBank):
    """The engine's ExpertBank, filled with random bf16 (a tiled 256 MB random block: contents
    do not change any timing) and pinned in place; plus the shared expert on the GPU."""

    def __init__(self, model: dict):
        super().__init__(model["layers"], model["experts"], model["hidden"], model["inter"], torch.bfloat16)
        self.model = model   # ExpertBank's storage is page-aligned: pin() registers it in place
        block = (torch.randn(1 << 27) * 0.02).to(torch.bfloat16)
        for t in (self.w13, self.w2):
            flat = t.view(-1)
            for i in range(0, flat.numel(), block.numel()):
                n = min(block.numel(), flat.numel() - i)
                flat[i:i + n].copy_(block[:n])
        self.pin()
        self.bytes = self.w13.nbytes + self.w2.nbytes
        si = model["shared_inter"]
        self.shared = None
        if si:
            L, H = model["layers"], model["hidden"]
            self.shared = ((torch.randn(L, 2 * si, H, device=CUDA) * 0.02).to(torch.bfloat16),
                           (torch.randn(L, H, si, device=CUDA) * 0.02).to(torch.bfloat16))
        self.shared_bytes = 3 * model["hidden"] * si * 2
        self._all = self._streamer = None

    def all_resident(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole bank on the GPU as a slot pool [L*E, ...] (slot = layer * E + expert)."""
        if self._all is None:
            self._all = (self.w13.view(-1, *self.w13.shape[2:]).to(CUDA),
                         self.w2.view(-1, *self.w2.shape[2:]).to(CUDA))
        return self._all

    def free(self) -> None:
        self._all = self._streamer = None
        torch.cuda.synchronize()
        self.unpin()          # and the bank's own mappings unregister when they go, just below
        self.w13 = self.w2 = None
        torch.cuda.empty_cache()


def routing_params(root: Path, model: dict) -> dict:
    """Locality-model parameters for ``model`` from the default model's measured routing
    statistics (bench/results/default_model.json, ``routing_by_k`` at the model's top-k, else
    the nearest k measured):

    - ``keep``: each of the previous token's experts is kept with this probability = the
      measured consecutive-token overlap beyond chance, (overlap - k/E) / (1 - k/E);
    - ``zipf``: per-layer popularity ~ rank^-zipf, the exponent fitted so that the normalized
      entropy of the per-layer selection shares (top-k draws) equals the measured mean.

    Without the file: documented assumed values (Zipf 0.8, keep 0.4)."""
    path = root / "bench/results/default_model.json"
    if not path.exists():
        return {"zipf": 0.8, "keep": 0.4, "source": "assumed (bench/results/default_model.json absent)"}
    stats = json.loads(path.read_text())["routing_by_k"]
    k = min(stats, key=lambda key: (abs(int(key) - model["top_k"]), -int(key)))
    row = stats[k]
    overlap, chance = row["consecutive_overlap_mean"], row["consecutive_overlap_random"]
    entropy = row["popularity"]["normalized_entropy_mean"]
    return {"zipf": fit_zipf(model["experts"], model["top_k"], entropy), "keep": (overlap - chance) / (1 - chance),
            "source": f"bench/results/default_model.json routing_by_k[{k}] ({stats[k]['tokens']} tokens, "
                      f"{json.loads(path.read_text())['num_experts']} experts)",
            "measured_overlap": overlap, "measured_overlap_random": chance,
            "measured_normalized_entropy": entropy,
            "measured_max_over_uniform": row["popularity"]["max_over_uniform_mean"]}


def _selection_entropy(experts: int, top_k: int, zipf: float, draws: int = 4096) -> float:
    """Normalized entropy of the selection shares of top-k draws (without replacement) from
    rank^-zipf popularity."""
    g = torch.Generator().manual_seed(0)
    w = torch.arange(1, experts + 1, dtype=torch.float64) ** -zipf
    picks = torch.multinomial(w.expand(draws, experts), top_k, generator=g).flatten()
    share = torch.bincount(picks, minlength=experts).double() / picks.numel()
    share = share[share > 0]
    return float(-(share * share.log()).sum() / torch.log(torch.tensor(float(experts))))


def fit_zipf(experts: int, top_k: int, entropy: float) -> float:
    """The Zipf exponent whose top-k selection shares have ``entropy`` (bisection)."""
    lo, hi = 0.0, 4.0
    for _ in range(24):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _selection_entropy(experts, top_k, mid) > entropy else (lo, mid)
    return (lo + hi) / 2


def routing_stats(ids: torch.Tensor, experts: int) -> dict:
    """What a generated routing ``[n_tok, L, T, k]`` achieved: consecutive-token overlap and the
    normalized entropy of the per-layer selection shares (the default model's statistics)."""
    n_tok, L, T, k = ids.shape
    hot = torch.zeros(n_tok, L, T, experts, dtype=torch.bool).scatter_(3, ids, True)
    overlap = float((hot[1:] & hot[:-1]).sum() / (hot[1:].sum())) if n_tok > 1 else float("nan")
    share = hot.sum((0, 2)).double()
    share = share / share.sum(1, keepdim=True)                                          # [L, E]
    ent = -(share * share.clamp_min(1e-30).log()).sum(1) / torch.log(torch.tensor(float(experts)))
    return {"consecutive_overlap": overlap, "normalized_entropy": float(ent.mean()), "tokens": n_tok}


def make_routing(model: dict, n_tok: int, batch: int, kind: str, params: dict, seed: int) -> torch.Tensor:
    """Top-k expert ids ``[n_tok, L, batch, k]`` (host int64), distinct within each row."""
    L, E, k = model["layers"], model["experts"], model["top_k"]
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        return torch.rand(n_tok, L, batch, E, generator=g).argsort(-1)[..., :k].contiguous()
    ranks = torch.arange(1, E + 1, dtype=torch.float64) ** -params["zipf"]
    pop = torch.stack([ranks[torch.randperm(E, generator=g)] for _ in range(L)])        # [L, E]
    out = torch.empty(n_tok, L, batch, k, dtype=torch.int64)
    for b in range(batch):
        prev = None
        for t in range(n_tok):
            w = pop.clone()
            if prev is None:
                out[t, :, b] = torch.multinomial(w, k, generator=g)
            else:
                keep = torch.rand(L, k, generator=g) < params["keep"]                   # [L, k]
                order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
                kept = torch.gather(prev, 1, order)                                      # kept first
                n_keep = keep.sum(1, keepdim=True)
                w.scatter_(1, prev, torch.where(keep, 0.0, w.gather(1, prev)))             # kept: not redrawn
                new = torch.multinomial(w, k, generator=g)
                j = torch.arange(k)[None, :]
                out[t, :, b] = torch.where(j < n_keep, kept, torch.gather(new, 1, (j - n_keep).clamp(min=0)))
            prev = out[t, :, b]
    return out


