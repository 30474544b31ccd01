"""A Gated DeltaNet layer's prompt chunk on a GPU: the chunks' state hand-over as torch's ops (a
few ops a 64-token chunk, issued from Python) against one Triton launch
(``kernels/triton/deltanet_chunk.py``), in Qwen3.6-35B-A3B's linear-attention shapes (32 value
heads, 16 key heads, 128 x 128 state per head, hidden 2048), bf16 weights, random values.

Per prompt length, every side in this process, alternating over ``--rounds`` (medians kept):
  rule/torch, rule/kernel   ``delta_rule_chunked`` whole (the chunks' insides, then the hand-over)
  hand-over/...             the hand-over alone, on the same precomputed insides: ``loop`` (the
                            first form: about nine ops a chunk), ``torch`` (``_hand_over``: three
                            ops a chunk, outputs batched per 16 chunks), ``kernel`` (tf32x3) and
                            ``kernel-ieee`` (float32 FMAs)
  layer/torch, layer/kernel the whole layer on a fresh sequence (projection, convolution, rule,
                            gated norm, output projection), as a prefill pass runs it
Each side's output is compared with its group's first side (max abs difference over the largest
output, float32 inside the rule). Writes JSON and a PNG (``--out``), the hardware named.

    python bench/deltanet_prefill.py --tokens 2048,8192,16384      # on the GPU machine
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from hardware import describe  # noqa: E402
from report import save  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` (synchronised) over ``reps`` calls, after one unmeasured."""
    fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_layer(device: str):
    from freetoken_engine.cache.states import StatePool
    from freetoken_engine.config import LinearAttnConfig
    from freetoken_engine.layers.deltanet import GatedDeltaNet
    lin = LinearAttnConfig(k_heads=16, v_heads=32, k_dim=128, v_dim=128, conv=4)
    gen = torch.Generator().manual_seed(0)
    layer = GatedDeltaNet(2048, lin, 0, 1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        layer.A_log.copy_(torch.rand(lin.v_heads, generator=gen).log())
    layer = layer.to(device, torch.bfloat16)
    layer.fuse()
    layer.states = StatePool(1, lin, live=1, checkpoints=0, dtype=torch.bfloat16, device=torch.device(device))
    return layer, lin


def rule_inputs(layer, x: torch.Tensor):
    """What the layer hands ``delta_rule_chunked`` for the prompt ``x``: q, k, v, g, beta."""
    import torch.nn.functional as F

    from freetoken_engine.layers.deltanet import causal_conv
    from freetoken_engine.layers.linear import linear
    mixed, _, b, a = linear(x, layer.proj, None).split(layer.sizes, -1)
    y, _ = causal_conv(mixed, layer.states.conv[0, 0].zero_(), layer.conv_w)
    q, k, v = layer._qkv(y)
    return q, k, v, layer.neg_a * F.softplus(a.float() + layer.dt_bias), b.sigmoid().float()


def parts(q, k, v, g, beta, state):
    """The chunks' insides, as ``delta_rule_chunked`` hands them to the kernel (captured)."""
    from freetoken_engine.kernels.triton import deltanet_chunk as kernel
    from freetoken_engine.layers.deltanet import delta_rule_chunked
    seen = {}

    class Capture:
        @staticmethod
        def chunk_states(*args):
            seen["args"] = args
            return kernel.chunk_states(*args)
    delta_rule_chunked(q, k, v, g, beta, state, kernel=Capture)
    return seen["args"]


def loop(ub, w, qg, attn, ke, carry, state):
    out, kd = torch.empty_like(ub), ke.transpose(-1, -2)
    for i in range(ub.shape[1]):
        u = ub[:, i] - w[:, i] @ state
        out[:, i] = qg[:, i] @ state + attn[:, i] @ u
        state = carry[:, i, None, None] * state + kd[:, i] @ u
    return out, state


def measure(tokens: int, rounds: int, reps: int, device: str) -> dict:
    import functools

    from freetoken_engine.kernels.triton import deltanet_chunk as kernel
    from freetoken_engine.layers.batch import AttnBatch
    from freetoken_engine.layers.deltanet import _hand_over, delta_rule_chunked
    layer, lin = make_layer(device)
    x = torch.randn(tokens, 2048, generator=torch.Generator().manual_seed(tokens)).to(device, torch.bfloat16)
    q, k, v, g, beta = rule_inputs(layer, x)
    state0 = torch.zeros(lin.v_heads, lin.k_dim, lin.v_dim, device=device)
    args = parts(q, k, v, g, beta, state0)
    ub, w, qg, attn, ke, carry, state = args
    batch = AttnBatch(positions=None, slot_mapping=None, q_seq=None, q_idx=None, kv_index=None, kv_valid=None,
                      q_max=tokens, seq_counts=(tokens,), seq_ends=(tokens,), state_slots=(0,))
    chunk_kernel = layer._chunk_kernel
    ieee = type("Ieee", (), {"chunk_states": staticmethod(functools.partial(kernel.chunk_states, precision="ieee"))})
    sides = {
        "rule/torch": lambda: delta_rule_chunked(q, k, v, g, beta, state0),
        "rule/kernel": lambda: delta_rule_chunked(q, k, v, g, beta, state0, kernel=kernel),
        "hand-over/loop": lambda: loop(*args),
        "hand-over/torch": lambda: _hand_over(ub, w, qg, attn, ke.transpose(-1, -2), carry[..., None, None], state),
        "hand-over/kernel": lambda: kernel.chunk_states(*args),
        "hand-over/kernel-ieee": lambda: ieee.chunk_states(*args),
        "layer/torch": lambda: layer(x, batch),
        "layer/kernel": lambda: layer(x, batch),
    }
    times = {name: [] for name in sides}
    for r in range(rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            layer._chunk_kernel = chunk_kernel if name.endswith("kernel") else (lambda _x: None)
            times[name].append(timed(sides[name], reps))
    diff = {}
    for what, base in (("rule", "rule/torch"), ("hand-over", "hand-over/loop"), ("layer", "layer/torch")):
        layer._chunk_kernel = lambda _x: None
        ref = sides[base]()
        ref = (ref[0] if isinstance(ref, tuple) else ref).float()
        for name in sides:
            if name.startswith(what + "/") and name != base:
                layer._chunk_kernel = chunk_kernel if name.endswith("kernel") else (lambda _x: None)
                o = sides[name]()
                diff[name] = float(((o[0] if isinstance(o, tuple) else o).float() - ref).abs().max() / ref.abs().max())
    layer._chunk_kernel = chunk_kernel
    return {"tokens": tokens, "seconds": {n: statistics.median(t) for n, t in times.items()},
            "all_seconds": times, "relative_max_diff_to_first_side": diff}


def table(rows: list[dict]) -> None:
    print(f"{'tokens':>7} {'side':>22} {'ms':>9} {'vs first':>9} {'rel diff':>9}")
    for row in rows:
        s = row["seconds"]
        first = {}
        for name, t in s.items():
            what = name.split("/")[0]
            first.setdefault(what, t)
            d = row["relative_max_diff_to_first_side"].get(name)
            print(f"{row['tokens']:>7} {name:>22} {t * 1e3:>9.2f} {first[what] / t:>8.2f}x "
                  f"{'' if d is None else f'{d:.1e}':>9}")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    names = list(rows[0]["seconds"])
    fig, ax = plt.subplots(figsize=(9, 4.8))
    xs = range(len(rows))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        ax.bar([x + (j - len(names) / 2 + 0.5) * width for x in xs], [r["seconds"][name] * 1e3 for r in rows],
               width, label=name)
    ax.set_xticks(list(xs), [f"{r['tokens']} tokens" for r in rows])
    ax.set_ylabel("ms per call (median)")
    ax.set_title(f"Gated DeltaNet prefill chunk, Qwen3.6 shapes, {result['hardware'].get('gpu', '?')}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="2048,8192,16384")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/deltanet_prefill.json"))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    if args.plot_only:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("deltanet_prefill.py: no CUDA GPU here (--device cpu under TRITON_INTERPRET=1 for a smoke run)")
    with torch.no_grad():
        rows = [measure(int(t), args.rounds, args.reps, args.device) for t in args.tokens.split(",")]
    table(rows)
    save({"benchmark": "deltanet_prefill", "hardware": describe(), "method": __doc__, "args": vars(args),
          "rows": rows}, out, plot)


if __name__ == "__main__":
    main()
