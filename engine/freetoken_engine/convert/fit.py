"""Offline MoEfication fitting: cluster each MLP's neurons into experts, fit the routers.

    python -m freetoken_engine.convert.fit [--experts 16] [--top-k 15] [--tokens 16384] [--capture FILE]

Deterministic (fixed seeds, fixed corpus order), about ten minutes on 2 CPU cores. Per layer:

1. Run the dense model over the FITTING text (`corpus.fitting_text`) and record each MLP's
   input x (the post-attention RMS-normed hidden state) for every token.
2. Neuron features: each intermediate neuron j's |activation| a_j(x) = |silu(g_j.x) * u_j.x|
   times ||down[:, j]|| over a sample of tokens, L2-normalised: neurons that contribute on the
   same tokens get similar features (co-activation clustering, as in MoEfication, Zhang et
   al. 2022).
3. Balanced spherical k-means into E clusters of exactly I/E neurons (greedy capacity-limited
   assignment each round), so all experts have the same size.
4. Router: a linear map x -> E logits fitted by least squares to each expert's output norm
   ||down_e a_e(x)||, centred per token (only the ranking within a token matters for top-k);
   then refined with a few hundred full-batch Adam steps on a listwise softmax loss against
   the true norms.

Writes `data/<name>.safetensors` with perms [L, I] int32 and routers [L, E, H] float32, and a
JSON sidecar with the GGUF's sha256, E, the default k and the corpus names. The default k
(`--top-k`) is chosen from bench/default_model.py's curve: the smallest k within 15% of dense.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import corpus
from .source import sha256_file

DATA = Path(__file__).parent / "data"


@torch.no_grad()
def capture_mlp_inputs(model, windows: list[list[int]]) -> list[torch.Tensor]:
    """Per layer, the MLP inputs of every token of every window: [N, H] float16."""
    store: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    run_windows(model, windows, [
        layer.mlp.register_forward_pre_hook(lambda m, args, i=i: store[i].append(args[0][0].half()))
        for i, layer in enumerate(model.model.layers)
    ])
    return [torch.cat(s) for s in store]


@torch.no_grad()
def run_windows(model, windows: list[list[int]], hooks: list) -> None:
    """The model over each window (one sequence each) with ``hooks`` recording, removed after."""
    try:
        for ids in windows:
            model.model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()


def activations(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU intermediate activations [N, I] for inputs x [N, H]."""
    x = x.float()
    return F.silu(x @ gate.T) * (x @ up.T)


def balanced_kmeans(feats: torch.Tensor, num_clusters: int, iters: int = 12, seed: int = 0) -> torch.Tensor:
    """Spherical k-means with equal cluster sizes; returns a permutation grouping the clusters.

    feats [I, D] (rows L2-normalised). Cluster c owns perm[c*I/E:(c+1)*I/E].
    """
    n = feats.shape[0]
    size = n // num_clusters
    g = torch.Generator().manual_seed(seed)
    centers = feats[torch.randperm(n, generator=g)[:num_clusters]].clone()
    for _ in range(iters):
        sim = feats @ centers.T  # [I, E]
        order = sim.flatten().argsort(descending=True, stable=True).tolist()
        owner = [-1] * n
        room = [size] * num_clusters
        for flat in order:
            j, c = divmod(flat, num_clusters)
            if owner[j] < 0 and room[c] > 0:
                owner[j] = c
                room[c] -= 1
        assign = torch.tensor(owner)
        new = torch.stack([F.normalize(feats[assign == c].mean(0), dim=0) for c in range(num_clusters)])
        if torch.allclose(new, centers):
            break
        centers = new
    return torch.cat([(assign == c).nonzero().squeeze(-1) for c in range(num_clusters)])


def expert_norms(act: torch.Tensor, down: torch.Tensor, perm: torch.Tensor, num_experts: int) -> torch.Tensor:
    """||down_e a_e|| per token and expert: [N, E]."""
    size = perm.numel() // num_experts
    cols = []
    for e in range(num_experts):
        idx = perm[e * size:(e + 1) * size]
        cols.append((act[:, idx] @ down[:, idx].T).norm(dim=-1))
    return torch.stack(cols, dim=-1)


def fit_router(x: torch.Tensor, target: torch.Tensor, steps: int = 100, seed: int = 0,
               refine_tokens: int = 4096) -> torch.Tensor:
    """Router [E, H] whose logits rank the experts of each token like `target` [N, E] does.

    Least squares on all N tokens, then `steps` Adam steps of a listwise softmax loss on a
    fixed sample of `refine_tokens` tokens (cheap on 2 cores).
    """
    x = x.float()
    t = target / target.mean(dim=-1, keepdim=True).clamp_min(1e-6)  # scale-free per token
    t = t - t.mean(dim=-1, keepdim=True)
    lam = 1e-3 * x.pow(2).sum(0).mean()
    w = torch.linalg.solve(x.T @ x + lam * torch.eye(x.shape[1]), x.T @ t).T.contiguous()  # [E, H]
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(x.shape[0], generator=g)[:refine_tokens]
    x, target = x[rows], target[rows]
    w = w.clone().requires_grad_(True)
    opt = torch.optim.Adam([w], lr=2e-3)
    soft = F.softmax(torch.log(target.clamp_min(1e-6)) * 4.0, dim=-1)  # sharpened true ranking
    for _ in range(steps):
        opt.zero_grad()
        loss = -(soft * F.log_softmax(x @ w.T, dim=-1)).sum(-1).mean()
        loss.backward()
        opt.step()
    return w.detach()


def fit_layer(x: torch.Tensor, gate, up, down, num_experts: int, sample: int = 4096, seed: int = 0):
    """(perm [I], router [E, H]) for one layer from its MLP inputs x [N, H]."""
    act = activations(x, gate, up)  # [N, I]
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(x.shape[0], generator=g)[:sample]
    feats = F.normalize((act[rows].abs() * down.norm(dim=0)).T, dim=-1)  # [I, sample]
    perm = balanced_kmeans(feats, num_experts, seed=seed)
    router = fit_router(x, expert_norms(act, down, perm, num_experts), seed=seed)
    return perm, router


def main(argv=None) -> None:
    from ..models.gguf import load_gguf
    from .evaluate import dense_transformers_model
    from .source import DEFAULT_TOP_K, artifact_paths, smollm2_gguf_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=DEFAULT_TOP_K)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--capture", type=Path, help="reuse (or save) the captured MLP inputs here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.time()
    gguf_path = smollm2_gguf_path()
    model = load_gguf(gguf_path)
    dense = dense_transformers_model(model.config, model.tensors)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(model.tokenizer_json)
    ids = tok.encode(corpus.fitting_text()).ids
    wins = corpus.windows(ids, args.window, args.tokens // args.window)
    if args.capture and args.capture.is_file():
        xs = torch.load(args.capture)
    else:
        xs = capture_mlp_inputs(dense, wins)
        if args.capture:
            torch.save(xs, args.capture)
    if sum(map(len, wins)) != xs[0].shape[0]:
        raise ValueError(f"{args.capture} holds {xs[0].shape[0]} tokens, expected {sum(map(len, wins))}")
    print(f"captured {sum(map(len, wins))} tokens in {time.time() - t0:.0f}s", flush=True)
    perms, routers = [], []
    for i, x in enumerate(xs):
        p = f"model.layers.{i}.mlp."
        perm, router = fit_layer(x, model.tensors[p + "gate_proj.weight"], model.tensors[p + "up_proj.weight"],
                                 model.tensors[p + "down_proj.weight"], args.experts, seed=i)
        perms.append(perm)
        routers.append(router)
        print(f"layer {i} fitted ({time.time() - t0:.0f}s)", flush=True)
    from safetensors.torch import save_file

    tensors_path, meta_path = artifact_paths(args.experts)
    DATA.mkdir(exist_ok=True)
    save_file({"perms": torch.stack(perms).to(torch.int32).contiguous(),
               "routers": torch.stack(routers).float().contiguous()}, str(tensors_path))
    meta = {
        "gguf_sha256": sha256_file(gguf_path),
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "fitting_text": corpus.FITTING_NAME,
        "fitting_tokens": sum(map(len, wins)),
        "fit_seconds": round(time.time() - t0, 1),
        "method": "co-activation balanced k-means; least squares + listwise-softmax router on expert output norms",
        "default_k_rule": "smallest k whose held-out perplexity is within 15% of dense "
                          "(no k <= E/2 is: see bench/results/default_model.json)",
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
