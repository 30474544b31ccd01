"""What n-gram speculative decoding (``--speculative-tokens K``) gains: decode tok/s of the same
greedy requests with K = 0 (off) and each K asked, in the same process, rounds interleaved, on
the embedded default model (SmolLM2-135M as an MoE) or ``--model``; and how many of the draft
tokens the model kept (acceptance), tokens per pass, passes.

Tasks: ``edit`` (a coding agent's request: change one name in a 30-line function and give the
whole code back: most of the answer is in the prompt), ``quote`` (repeat a paragraph with one
word changed) and ``open`` (a question whose answer is not in the prompt: drafts are rare, so it
shows what speculation costs when it does not help). Every side's tokens are checked equal to
K = 0's (the run fails otherwise). Last, what one verification pass of k draft tokens costs
against a one-token pass (``pass_costs``).

    python bench/speculative.py [--ks 2 4 8] [--tokens 160] [--rounds 3] [--device cpu|cuda]
        [--model DIR] [--clients N] [--out bench/results/speculative.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import describe  # noqa: E402
from report import save  # noqa: E402

from freetoken_engine import LLM, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CODE = '''def total(items, tax_rate=0.2, discount=None):
    """Sum the price of every item, apply a discount code if given, then add tax."""
    subtotal = 0.0
    for item in items:
        price = item["price"] * item.get("quantity", 1)
        if item.get("on_sale"):
            price = price * 0.9
        subtotal += price
    if discount is not None:
        if discount.endswith("%"):
            subtotal -= subtotal * float(discount[:-1]) / 100
        else:
            subtotal -= float(discount)
    if subtotal < 0:
        subtotal = 0.0
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)


def format_receipt(items, tax_rate=0.2, discount=None):
    lines = []
    for item in items:
        lines.append(f"{item['name']:<20} {item['price']:>8.2f} x {item.get('quantity', 1)}")
    lines.append(f"{'total':<20} {total(items, tax_rate, discount):>8.2f}")
    return "\\n".join(lines)
'''
PARAGRAPH = ("The expert cache keeps the most recently used experts of every layer on the GPU. When a "
             "token needs an expert that is not there, the engine either copies it over PCIe into the "
             "slot of the least recently used one, or computes it on the CPU where it lives, and it "
             "splits the misses between the two so that both finish at the same time.")
TASKS = {
    "edit": f"Rename the function `total` to `order_total` everywhere in this code and reply with the whole "
            f"code, nothing else.\n\n```python\n{CODE}```",
    "quote": f"Repeat this paragraph exactly, but write 'graphics card' instead of 'GPU':\n\n{PARAGRAPH}",
    "open": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def pass_costs(llm, ks: list[int], reps: int = 20) -> dict:
    """Milliseconds of one decode pass (``ModelRunner.forward``) at a 300-token context: one
    token, and a verification of k draft tokens, median of ``reps``; and their ratios."""
    import time

    from freetoken_engine.executor.inputs import SeqChunk
    kv = llm.runner.kv
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "word " * 300}])
    blocks = kv.allocate(kv.blocks_for(len(ids) + max(ks) + 1))
    try:
        llm.runner.forward([SeqChunk(blocks, 0, ids[:-1])])
        n = len(ids) - 1

        def timed(k: int) -> float:
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                llm.runner.forward([SeqChunk(blocks, n, [ids[-1]] + [5] * k, rows=k + 1)])
                times.append(time.perf_counter() - t)
            return statistics.median(times) * 1e3
        ms = {str(k): timed(k) for k in [0, *ks]}
    finally:
        kv.release(blocks)
    return {"ms": ms, "ratio": {k: v / ms["0"] for k, v in ms.items()}}


def run(ks: list[int], tokens: int, rounds: int, model: Path | None, device: str) -> dict:
    sides = [0, *ks]
    llms = {k: LLM(model, device=device, speculative_tokens=k) for k in sides}
    tok = llms[0].tokenizer
    prompts = {name: tok.encode_chat([{"role": "user", "content": text}]) for name, text in TASKS.items()}
    params = SamplingParams(max_new_tokens=tokens, temperature=0)
    out = {name: {str(k): {"decode_tok_s": []} for k in sides} for name in TASKS}
    for _ in range(rounds):
        for name, prompt in prompts.items():
            want = None
            for k in sides:
                gen = llms[k].generate(prompt, params)
                if want is None:
                    want = gen.token_ids
                    out[name]["text"] = tok.decode(gen.token_ids)
                elif gen.token_ids != want:
                    raise SystemExit(f"{name}: K={k} changed the output")
                r = out[name][str(k)]
                r["decode_tok_s"].append(gen.stats["decode_tokens_per_s"])
                r.update(generated=len(gen.token_ids), passes=gen.stats["decode_passes"],
                         drafted=gen.stats["draft_tokens"], kept=gen.stats["draft_tokens_kept"])
    for name in TASKS:
        base = statistics.median(out[name]["0"]["decode_tok_s"])
        for k in sides:
            r = out[name][str(k)]
            r["decode_tok_s_median"] = statistics.median(r["decode_tok_s"])
            r["speedup"] = r["decode_tok_s_median"] / base
            r["acceptance"] = r["kept"] / r["drafted"] if r["drafted"] else None
            r["tokens_per_pass"] = (r["generated"] - 1) / r["passes"] if r["passes"] else None
    name = str(model) if model else "embedded default (SmolLM2-135M-Instruct as an MoE, 30 layers, E=16, k=15)"
    costs = pass_costs(llms[0], sorted(set(ks) | {1}))
    return {"benchmark": "speculative", "model": name, "device": device, "tokens": tokens, "rounds": rounds,
            "pass_costs": costs,
            "method": "greedy, one request at a time through LLM.generate; decode tok/s = (generated - 1) / decode "
                      "time; speedup = median tok/s over K=0's, the same tokens checked equal",
            "hardware": describe(), "tasks": out}


def run_concurrent(k: int, clients: int, tokens: int, rounds: int, model: Path | None, device: str) -> dict:
    """``clients`` requests at once through the scheduler (EngineService), the three tasks in
    turn: no drafts, K drafts only in steps with one decoding request (the default
    ``--speculative-max-batch 1``), and K drafts in every step (``--speculative-max-batch
    clients``). The three services run side by side, rounds interleaved; aggregate generated
    tok/s (median over rounds), draft tokens and their acceptance; every request's tokens checked
    equal across sides."""
    import asyncio
    import time

    from freetoken_engine.config import EngineConfig
    from freetoken_engine.models.default import default_model_dir
    from freetoken_engine.scheduler.service import EngineService

    folder = model or default_model_dir(progress=False)
    sides = {"no drafts": (0, 1), f"K={k}, max batch 1": (k, 1), f"K={k}, max batch {clients}": (k, clients)}
    services = {name: EngineService.start(EngineConfig(model=folder, device=device, max_batch=clients,
                                                       speculative_tokens=kk, speculative_max_batch=mb), wait=True)
                for name, (kk, mb) in sides.items()}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    want = None
    try:
        tok = next(iter(services.values())).tokenizer
        texts = list(TASKS.values())
        prompts = [tok.encode_chat([{"role": "user", "content": texts[i % len(texts)]}]) for i in range(clients)]
        params = SamplingParams(max_new_tokens=tokens, temperature=0)
        for _ in range(rounds):
            for name, svc in services.items():
                async def one(p, svc=svc):
                    return [ev.token_id async for ev in svc.submit(p, params) if ev.token_id is not None]

                async def all_of():
                    return await asyncio.gather(*(one(p) for p in prompts))
                t = time.perf_counter()
                got = asyncio.run(all_of())
                rates[name].append(sum(map(len, got)) / (time.perf_counter() - t))
                if want is None:
                    want = got
                elif got != want:
                    raise SystemExit(f"{clients} clients: {name} changed the output")
        out = {}
        for name, svc in services.items():
            st = svc.stats()
            out[name] = {"tok_s": statistics.median(rates[name]), "tok_s_rounds": rates[name],
                         "draft_tokens": st["draft_tokens"],
                         "acceptance": st["draft_tokens_kept"] / st["draft_tokens"] if st["draft_tokens"] else None}
    finally:
        for svc in services.values():
            svc.shutdown()
    for r in out.values():
        r["speedup"] = r["tok_s"] / out["no drafts"]["tok_s"]
    return {"clients": clients, "k": k, "sides": out}


def plot(result: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = result["tasks"]
    ks = [k for k in next(iter(tasks.values())) if k != "text"]
    conc = result.get("concurrent")
    fig, axes = plt.subplots(1, 2 if conc else 1, figsize=(11 if conc else 7, 4), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1]} if conc else None)
    ax = axes[0][0]
    width = 0.8 / len(ks)
    for i, k in enumerate(ks):
        ax.bar([j + i * width for j in range(len(tasks))], [tasks[t][k]["speedup"] for t in tasks], width,
               label="off" if k == "0" else f"K={k}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([j + width * (len(ks) - 1) / 2 for j in range(len(tasks))], list(tasks))
    ax.set_ylabel("decode tok/s relative to no speculation")
    hw = result["hardware"]
    ax.set_title(f"n-gram speculative decoding, {result['device']} ({hw.get('gpu') or hw['cpu']}, "
                 f"{hw['cores']} CPUs)", fontsize=9)
    ax.legend()
    if conc:
        cx = axes[0][1]
        names = list(conc["sides"])
        cx.bar(range(len(names)), [conc["sides"][n]["speedup"] for n in names])
        cx.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        cx.axhline(1.0, color="grey", lw=0.8)
        cx.set_title(f"{conc['clients']} requests at once (aggregate tok/s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    ap.add_argument("--clients", type=int, default=0,
                    help="also N requests at once through the scheduler (the three tasks in turn): no drafts, "
                         "K = 4 drafts in steps of one decoding request (the default), in every step")
    ap.add_argument("--concurrent-only", action="store_true",
                    help="only the --clients run (printed, not saved)")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    if args.plot_only:
        import json
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    if args.concurrent_only:
        r = run_concurrent(max(args.ks), args.clients, args.tokens, args.rounds, args.model, args.device)
        for name, side in r["sides"].items():
            print(f"{args.clients} clients, {name}: {side['tok_s']:.1f} tok/s {side['speedup']:.2f}x "
                  f"({side['draft_tokens']} draft tokens)")
        return
    result = run(args.ks, args.tokens, args.rounds, args.model, args.device)
    print(f"{'task':<6} {'K':>3} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'tok/pass':>8} {'passes':>6}")
    for name, sides in result["tasks"].items():
        for k, r in sides.items():
            if k == "text":
                continue
            acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
            tpp = f"{r['tokens_per_pass']:.2f}" if r["tokens_per_pass"] else "-"
            print(f"{name:<6} {k:>3} {r['decode_tok_s_median']:>8.1f} {r['speedup']:>7.2f}x {acc:>7} {tpp:>8} "
                  f"{r['passes']:>6}")
    if args.clients:
        result["concurrent"] = run_concurrent(4 if 4 in args.ks else max(args.ks), args.clients, args.tokens,
                                              args.rounds, args.model, args.device)
        for name, r in result["concurrent"]["sides"].items():
            acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
            print(f"{args.clients} clients, {name}: {r['tok_s']:.1f} tok/s {r['speedup']:.2f}x "
                  f"({r['draft_tokens']} draft tokens, accept {acc})")
    print("pass cost against one token's:", ", ".join(f"{k} drafts {r:.2f}x" for k, r in
                                                      result["pass_costs"]["ratio"].items() if k != "0"))
    save(result, args.out, plot)


if __name__ == "__main__":
    main()
