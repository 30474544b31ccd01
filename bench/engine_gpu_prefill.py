"""The whole engine's prefill on a GPU, by prefill chunk size: what a long prompt costs a user.

A prefill step streams every expert that the GPU's cache lacks, layer by layer (cache/prefetch.py),
whatever the step's size. A prompt prefilled in chunks of C tokens streams them once per chunk:
with a consumer card's cache the stream, not the arithmetic, is the cost, so the chunk size sets
the prompt's time. This bench times the engine a user runs (``LLM``: attention over the paged KV
pool, routers, the whole-layer MoE with the cached experts in place, the seed of the decode cache
in the last chunk, the LM head) on one checkpoint, in one process, for each expert-cache budget
(a card's, as bench/gpu_offload.py sizes them, or "all": every expert on the GPU), prompt
length and chunk size. Rounds run the chunk sizes in ABBA order; the report keeps medians.

Per row: seconds to the first token's logits (prefill only, synchronised), tokens/s, the GPU
memory the prefill took above what was allocated before it (peak), and the streaming bound:
chunks x (expert bytes not cached) / B_pcie, B_pcie measured in the same run (pinned
host-to-device copies of whole layers of the engine's own bank). The last token's logits of every
chunk size are compared with the largest chunk's (bf16: a different chunking adds in a different
order; the greedy next token and the max abs difference are reported).

Checkpoint: bench/engine_gpu_decode.py's (random bf16 weights in Qwen3-30B-A3B's shapes, or
Qwen3.6's with ``--shape qwen3.6``; ``--stretch /dev/shm``: a 2-layer packed checkpoint repeated to
``--layers``), with max_position_embeddings raised to hold the longest prompt.

    python bench/engine_gpu_prefill.py --layers 48 --stretch /dev/shm    # on the GPU machine
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from hardware import describe  # noqa: E402
from report import save  # noqa: E402


def raise_context(model: Path, tokens: int) -> None:
    """Let the checkpoint's config hold ``tokens`` positions (a new file: the old may be a hard link)."""
    cfg_path = model / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), tokens)
    cfg_path.unlink()
    cfg_path.write_text(json.dumps(cfg))


def card_experts(card: str, shape: str, layers: int, total: int) -> int:
    """Expert slots of a ``card`` ("all", or GiB: bench/prefill_cached.py's share of a card's slots
    for the full model, scaled to ``layers``)."""
    if card == "all":
        return total
    from offload_workload import MODELS
    from prefill_cached import cache_slots
    name = "qwen3-30b-a3b" if shape == "qwen3-30b" else "qwen3.6-35b-a3b"
    return cache_slots(float(card), dict(MODELS[name], layers=layers), MODELS[name]["layers"])


def prefill(llm, ids: list[int], chunk: int) -> tuple[float, int, torch.Tensor]:
    """Prefill ``ids`` in ``chunk``-token steps; -> (seconds, peak bytes above the start, last logits)."""
    cuda = llm.runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with torch.inference_mode():
        blocks, logits = llm._run(ids, chunk)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    llm.runner.kv.release(blocks)
    return seconds, peak, logits.float().cpu()


def profile(llm, tokens: int, chunk: int, out: Path) -> None:
    """Where a prefill's time goes: cProfile of the host (by cumulative time) and torch.profiler's
    operators (by CPU and by CUDA time) over one ``tokens``-token prefill in ``chunk``-token steps."""
    import cProfile
    import io
    import pstats
    ids = torch.randint(100, llm.runner.mcfg.vocab_size - 1, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    prefill(llm, ids, chunk)
    prof = cProfile.Profile()
    prof.enable()
    seconds, _, _ = prefill(llm, ids, chunk)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    print(f"prefill {tokens} tokens in {chunk}-token steps: {seconds:.3f} s under cProfile")
    print(text.getvalue()[-9000:])
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        prefill(llm, ids, chunk)
    for key in ("self_cpu_time_total", "cuda_time_total"):
        print(tp.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))
    out.parent.mkdir(parents=True, exist_ok=True)
    tp.export_chrome_trace(str(out.with_suffix(".trace.json")))


def card_rows(llm, card: str, args, gbps: float, expert_bytes: int, side: str = "fill free",
              prompts: list[int] | None = None, chunks: list[int] | None = None) -> list[dict]:
    """One card's rows, from an empty cache (a fresh start): ``side`` "fill free" (the engine:
    the prefill fills the empty slots, ``OffloadedExperts.prefill_fills_free``), "seeds only"
    (the engine before: only the prompt's last chunk seeds the cache with its last token's experts)
    or "repeated heads" (the engine before the twenty-fifth session: a chunk's keys and values
    repeated to every query head before the flash call, ``Attention.grouped_flash``)."""
    from freetoken_engine.cache.offload import OffloadedExperts
    from freetoken_engine.layers.attention import Attention
    OffloadedExperts.prefill_fills_free = side != "seeds only"
    Attention.grouped_flash = side != "repeated heads"
    runner = llm.runner
    total = runner.bank.total_experts if runner.bank is not None else 0
    slots = card_experts(card, args.shape, args.layers, total) if total else 0
    if total:
        runner.resize_expert_cache(1)            # empty (a resize keeps the most recent residents)
        runner.resize_expert_cache(slots)
        torch.cuda.empty_cache()
    cached = min(runner.expert_stats()["capacity_experts"], total) if total else 0
    missing = (total - cached) * expert_bytes
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in prompts or [int(t) for t in args.prompts.split(",")]:
        ids = torch.randint(100, runner.mcfg.vocab_size - 1, (tokens,), generator=gen).tolist()
        sizes = [c for c in (chunks or [int(c) for c in args.chunks.split(",")]) if c <= tokens]
        prefill(llm, ids, min(sizes))           # untimed: kernels, allocations, the first fills and seeds
        logits = {}
        for rnd in range(args.rounds):
            for chunk in (sizes if rnd % 2 == 0 else sizes[::-1]):
                seconds, peak, logits[chunk] = prefill(llm, ids, chunk)
                n = -(-tokens // chunk)
                rows.append({"card": card, "side": side, "cached_experts": cached, "total_experts": total,
                             "cached_fraction": cached / total if total else 1.0, "tokens": tokens,
                             "chunk": chunk, "chunks": n, "round": rnd, "seconds": seconds, "peak_bytes": peak,
                             "resident_experts": runner.cache.resident() if total else 0,
                             "stream_bytes": n * missing,
                             "bound_seconds": n * missing / (gbps * 1e9) if gbps else 0.0})
                print(json.dumps(rows[-1]), flush=True)
        ref = logits[max(sizes)]
        for r in rows:
            if r["tokens"] == tokens:
                got = logits[r["chunk"]]
                r["max_abs_difference"] = float((got - ref).abs().max())
                r["same_next_token"] = int(got.argmax()) == int(ref.argmax())
    OffloadedExperts.prefill_fills_free = Attention.grouped_flash = True
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Each (card, prompt, chunk)'s median over its rounds, with its speed against 512-token chunks."""
    out = []
    keys = dict.fromkeys((r["card"], r["side"], r["tokens"], r["chunk"]) for r in rows)
    for key in keys:
        rs = [r for r in rows if (r["card"], r["side"], r["tokens"], r["chunk"]) == key]
        tokens = key[2]
        med = dict(rs[0], seconds=statistics.median(r["seconds"] for r in rs),
                   peak_bytes=max(r["peak_bytes"] for r in rs))
        med.pop("round")
        med["tok_s"] = tokens / med["seconds"]
        med["fraction_of_bound"] = med["bound_seconds"] / med["seconds"]
        out.append(med)
    for r in out:
        base = next((x for x in out if (x["card"], x["side"], x["tokens"]) == (r["card"], r["side"], r["tokens"])
                     and x["chunk"] == 512), None)
        r["speedup_vs_512"] = base["seconds"] / r["seconds"] if base else None
    return out


def table(rows: list[dict]) -> None:
    print(f"{'card':>5} {'side':10} {'cached':>7} {'tokens':>6} {'chunk':>6} {'s':>7} {'tok/s':>8} {'bound s':>8} "
          f"{'of bound':>8} {'vs 512':>7} {'peak GB':>8} {'same tok':>8} {'max diff':>8}")
    for r in rows:
        speed = f"{r['speedup_vs_512']:6.2f}x" if r["speedup_vs_512"] else "      -"
        print(f"{r['card']:>5} {r['side']:10} {r['cached_fraction']:7.0%} {r['tokens']:6d} {r['chunk']:6d} {r['seconds']:7.3f} "
              f"{r['tok_s']:8.0f} {r['bound_seconds']:8.3f} {r['fraction_of_bound']:8.2f} {speed} "
              f"{r['peak_bytes'] / 1e9:8.2f} {str(r['same_next_token']):>8} {r['max_abs_difference']:8.4f}")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["summary"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for card in dict.fromkeys(r["card"] for r in rows):
        for tokens in dict.fromkeys(r["tokens"] for r in rows):
            rs = [r for r in rows if r["card"] == card and r["tokens"] == tokens and r["side"] == "fill free"]
            if not rs:
                continue
            label = f"{card} GB" if card != "all" else "all experts on the GPU"
            ax.plot([r["chunk"] for r in rs], [r["tok_s"] for r in rs], marker="o",
                    label=f"{label}, {tokens}-token prompt")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prefill chunk (tokens per step)")
    ax.set_ylabel("prefill tokens/s (median)")
    ax.set_title(f"engine prefill by chunk size ({result['layers']} layers, {result['shape']})\n"
                 f"{result['hardware'].get('gpu', '?')}, {result['hardware']['cpu']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shape", default="qwen3-30b", choices=("qwen3-30b", "qwen3.6", "qwen3.6-hybrid"))
    ap.add_argument("--stretch", type=Path, default=None, metavar="FAST_DIR",
                    help="a 2-layer packed checkpoint repeated to --layers layers under FAST_DIR (bench/stretch.py)")
    ap.add_argument("--cards", default="16,32,all", help="expert-cache budgets: card GiB, or all")
    ap.add_argument("--prompts", default="4096,8192,16384")
    ap.add_argument("--chunks", default="512,2048,8192,16384")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ab-cards", default="32,all", help="cards also run as the engine before (--ab-side)")
    ap.add_argument("--ab-side", default="seeds only", choices=("seeds only", "repeated heads"),
                    help="which engine before: the prefill not filling the cache, or keys repeated to every head")
    ap.add_argument("--ab-prompts", default="8192")
    ap.add_argument("--ab-chunks", default="2048,8192")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=str(ROOT / "bench/results/engine_gpu_prefill.json"))
    ap.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                    help="only profile one TOKENS-token prefill in the smallest --chunks steps with every expert cached")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out")
    args = ap.parse_args()
    out = Path(args.out)
    if args.plot_only:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return
    from stretch import bench_checkpoint

    from freetoken_engine import LLM
    longest = max(int(t) for t in args.prompts.split(","))
    with tempfile.TemporaryDirectory(dir=args.stretch) as fast, tempfile.TemporaryDirectory() as work:
        t0 = time.perf_counter()
        model, nbytes = bench_checkpoint(Path(work), args.layers, Path(fast) if args.stretch else None, args.shape)
        raise_context(model, longest + 64)
        print(f"checkpoint: {args.layers} layers, {nbytes / 1e9:.1f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
        t0 = time.perf_counter()
        # the prefill alone: no decode graphs, q* held (prefill streams whole layers; no CPU experts)
        llm = LLM(model, device=args.device, dtype="bfloat16", cuda_graphs=False, graph_warmup=0,
                  cpu_expert_fraction=0.0, max_context=longest + 64, kv_cache_tokens=longest + 64,
                  max_batch=4)
        print(f"engine ready in {time.perf_counter() - t0:.0f} s", flush=True)
        bank = llm.runner.bank
        cuda = llm.runner.device.type == "cuda"
        gbps = 0.0
        if cuda and bank is not None:
            from prefill_cached import pcie_gbps      # (a CUDA machine's module: Triton, the MoE kernels)
            gbps = pcie_gbps(bank)
        expert_bytes = bank.expert_bytes if bank is not None else 0
        if args.profile:
            profile(llm, args.profile, min(int(c) for c in args.chunks.split(",")), out)
            return
        result = {"benchmark": "engine_gpu_prefill", "shape": args.shape, "layers": args.layers,
                  "hardware": describe(), "b_pcie_gbps": gbps, "expert_bytes": expert_bytes, "method": __doc__,
                  "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": []}
        for card in (args.cards.split(",") if cuda else ["all"]):
            if card in args.ab_cards.split(","):       # the engine before, from the same empty cache
                result["rows"] += card_rows(llm, card, args, gbps, expert_bytes, args.ab_side,
                                            [int(t) for t in args.ab_prompts.split(",")],
                                            [int(c) for c in args.ab_chunks.split(",")])
            result["rows"] += card_rows(llm, card, args, gbps, expert_bytes)
    result["summary"] = summary(result["rows"])
    table(result["summary"])
    print(f"B_pcie {gbps:.1f} GB/s, {result['hardware'].get('gpu', result['hardware']['cpu'])}")
    save(result, out, plot)


if __name__ == "__main__":
    main()
