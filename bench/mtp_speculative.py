"""What MTP drafts cost and save: decode tok/s of one request on a random hybrid checkpoint with a
multi-token-prediction layer (``--shape``: Qwen3.6-35B-A3B's layers, or ``hybrid-small`` for a
2-CPU machine; ``--layers`` layers, safetensors in ``--work``), plain decode against MTP drafts of
up to K tokens at a fixed acceptance A, in one process (one engine, the MTP layer loaded for
every side), rounds interleaved.

The drafts are the MTP head's own (its catch-up pass over each step's rows and its chain of K - 1
further passes, the LM head on each: the real cost), but a random head predicts nothing, so
which draft tokens are kept is a seeded coin per position with probability A (``--acceptance``);
the verification runs as in the engine (a pass of K + 1 tokens, the sampling of every row).
What A a real checkpoint's head reaches is the checkpoint's (Qwen reports its MTP layers' drafts
as mostly kept on chat and code; not measured here: no real weights can be fetched).

``--routing locality`` replays the MoE bench's routing (fitted to the default model's measured
routing: popularity skew and token-to-token overlap) through every router, the MTP layer's too; a
pass of n rows routes as n consecutive decode steps, so a verification reads the experts of that
many steps together, not n times a step's.

Also timed alone, in the same process: one MTP pass of one token plus its LM head, against one
plain decode step (the model's own pass).

    python bench/mtp_speculative.py --device cpu --shape hybrid-small --layers 8 --dtype bfloat16
    python bench/mtp_speculative.py --device cuda --shape qwen3.6-hybrid --layers 8 --work /dev/shm
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from hardware import describe  # noqa: E402
from report import save  # noqa: E402
from speculative_offload import Coin, record_run, verification_tables  # noqa: E402


def sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def pass_costs(llm, device: str, draft_vocab: int = 0, reps: int = 30) -> dict:
    import torch
    with torch.inference_mode():
        return _pass_costs(llm, device, draft_vocab, reps)


def _pass_costs(llm, device: str, draft_vocab: int, reps: int) -> dict:
    """Seconds of one plain decode step and of one MTP pass of one token plus its LM head."""
    import torch

    from freetoken_engine.executor.inputs import SeqChunk
    runner, kv = llm.runner, llm.runner.kv
    blocks, slot = kv.allocate(kv.blocks_for(64)), llm._slot()
    try:
        hidden = torch.zeros(1, runner.mcfg.hidden_size, dtype=runner.dtype, device=runner.device)
        out = {}
        steps = [("decode_step_s", lambda i: runner.forward([SeqChunk(blocks, 8 + i, [11], state=slot)])),
                 ("mtp_pass_s", lambda i: runner.model.logits(runner.mtp_forward([SeqChunk(blocks, 8 + i, [11])], hidden)))]
        if draft_vocab:
            steps.append(("mtp_pass_draft_vocab_s", lambda i: runner.model.logits(
                runner.mtp_forward([SeqChunk(blocks, 8 + i, [11])], hidden), draft_vocab)))
        for name, step in steps:
            for i in range(3):
                step(i)
            sync(device)
            t0 = time.perf_counter()
            for i in range(reps):
                step(i % 48)
            sync(device)
            out[name] = (time.perf_counter() - t0) / reps
        return out
    finally:
        llm._release(blocks, slot)


def run(args) -> dict:
    import torch

    import freetoken_engine.llm as llm_module
    from freetoken_engine import LLM, SamplingParams
    from fast_load import write_checkpoint

    work = Path(tempfile.mkdtemp(dir=args.work))
    try:
        gen = torch.Generator().manual_seed(0)
        folder = work / "model"
        nbytes = write_checkpoint(folder, args.layers, rnd=lambda s: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16),
                                  shape=args.shape, mtp=True, vocab=args.vocab)
        llm = LLM(folder, device=args.device, dtype=args.dtype, speculative_tokens=max(args.ks),
                  speculative_method="mtp", graph_warmup=0)
        runner = llm.runner
        routing = None
        if args.routing != "router":   # replayed: a pass of n rows routes as n consecutive decode steps
            from routing_replay import install
            routing = install(runner.model, args.routing, [1])
            verification_tables(runner.model, list(range(1, max(args.ks) + 1)))
        from freetoken_engine.executor import runner as runner_module
        chained, mtp_rows = runner.chained_rows, runner_module.MTP_ROWS
        coin = Coin()
        llm_module.verify = coin.verify
        prompt = [int(t) for t in torch.randint(10, 30000, (32,), generator=torch.Generator().manual_seed(0))]
        params = SamplingParams(max_new_tokens=args.tokens, temperature=0, ignore_eos=True)
        sides = [("plain", 0, None)] + [(f"K={k} A={a:g}", k, a) for k in args.ks for a in args.acceptance]
        if args.draft_vocab:          # the same drafts' cost among the first N token ids only
            sides += [(f"K={k} A={a:g} dv={args.draft_vocab}", k, a) for k in args.ks for a in args.acceptance]
        if args.ab_rows:              # the same drafts with the passes as before 2026-12-02: chunks
            sides += [(f"K={k} A={a:g} /chunks", k, a) for k in args.ks for a in args.acceptance]
        res = {name: {"tok_s": [], "passes": [], "drafted_per_pass": []} for name, _, _ in sides}
        for rnd in range(args.rounds + 1):                       # round 0 warms up (and captures graphs)
            for name, k, a in sides:
                llm.config = dataclasses.replace(llm.config, speculative_tokens=k,
                                                 speculative_method="mtp" if k else "ngram",
                                                 speculative_draft_vocab=args.draft_vocab if "dv=" in name else 0)
                coin.acceptance = a or 0.0
                chunks = name.endswith("/chunks")  # verification and MTP passes as chunks (eager on a GPU)
                runner.chained_rows = chained and not chunks
                runner_module.MTP_ROWS = 0 if chunks else mtp_rows
                g = llm.generate(prompt, params)
                if rnd:
                    record_run(res[name], g.stats)
        costs = pass_costs(llm, args.device, args.draft_vocab)
        base = statistics.median(res["plain"]["tok_s"])
        rows = []
        for name, k, a in sides:
            r = res[name]
            rows.append({"side": name, "k": k, "acceptance": a, "tok_s": statistics.median(r["tok_s"]),
                         "tok_s_rounds": r["tok_s"], "vs_plain": statistics.median(r["tok_s"]) / base,
                         "passes": statistics.median(r["passes"]),
                         "drafted_per_pass": statistics.median(r["drafted_per_pass"])})
            print(f"{name:<20} {rows[-1]['tok_s']:>8.1f} tok/s {rows[-1]['vs_plain']:>6.2f}x "
                  f"passes {rows[-1]['passes']:>5.0f} drafted/pass {rows[-1]['drafted_per_pass']:>4.1f}", flush=True)
        print(f"one decode step {costs['decode_step_s'] * 1e3:.2f} ms, one MTP pass + LM head "
              f"{costs['mtp_pass_s'] * 1e3:.2f} ms ({costs['mtp_pass_s'] / costs['decode_step_s']:.2f}x)"
              + (f", among {args.draft_vocab} ids {costs['mtp_pass_draft_vocab_s'] * 1e3:.2f} ms" if args.draft_vocab else ""))
        graphs = runner.graph_stats()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"benchmark": "mtp_speculative", "hardware": describe(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", "bench/mtp_speculative.py"] + sys.argv[1:]),
            "method": __doc__, "shape": args.shape, "layers": args.layers, "dtype": args.dtype, "routing": routing,
            "vocab": args.vocab, "draft_vocab": args.draft_vocab,
            "checkpoint_bytes": nbytes, "pass_costs": costs, "graphs": graphs, "rows": rows}


def plot(result: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(range(len(rows)), [r["vs_plain"] for r in rows])
    ax.set_xticks(range(len(rows)), [r["side"] for r in rows], rotation=45, ha="right", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("decode tok/s / plain")
    c = result["pass_costs"]
    ax.set_title(f"MTP drafts at a fixed acceptance, {result['layers']}-layer {result['shape']}, "
                 f"{result['hardware'].get('gpu') or result['hardware']['cpu']}\none MTP pass = "
                 f"{c['mtp_pass_s'] / c['decode_step_s']:.2f}x a decode step", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shape", default="hybrid-small", choices=("hybrid-small", "qwen3.6-hybrid"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--work", type=Path, default=None, help="where the checkpoint is written (default: a temp dir)")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--vocab", type=int, default=32000, help="the checkpoint's vocabulary (Qwen3.6: 248320)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="also run each side drafting among the first N token ids (--speculative-draft-vocab)")
    ap.add_argument("--routing", default="router", choices=("router", "locality", "uniform"),
                    help="router: the random checkpoint's own routers (each token its own experts); locality: "
                         "the MoE bench's replayed routing fitted to the default model's (bench/routing_replay.py)")
    ap.add_argument("--acceptance", type=float, nargs="+", default=[1.0, 0.7, 0.5])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ab-rows", action="store_true",
                    help="also each drafted side with its verification and MTP passes as chunks, as before "
                         "chained decode rows (2026-12-02): an A/B in the same process")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    kind = "gpu" if args.device.startswith("cuda") else "cpu"
    out = args.out or ROOT / f"bench/results/mtp_speculative_{kind}{'' if args.routing == 'router' else '_' + args.routing}.json"
    save(run(args), out, plot)


if __name__ == "__main__":
    main()
