"""Benchmark: the MoE combine as one compiled call on the CPU (``kernels/cpu/combine.py``)
against torch's ops (``reference.moe_combine_forward``: a ``[T, k, H]`` product tensor and a
sum over it), inside the engine, in one process.

    python bench/cpu_combine.py [--prompt-tokens 2048] [--tokens 32] [--rounds 3] [--only default-bf16,...]

The combine runs wherever the layers' modules run on the CPU: prompt chunks, and decode passes
of more than 8 rows (fewer go through the fused decode layers, whose combine is the same
compiled call). Per model (``bench/fused_cpu_decode.py``'s) one engine; the sides differ only in
the combine ``layers/moe.py`` calls, and alternate, which first, ``--rounds`` times: the time to
the first token of a ``--prompt-tokens`` prompt of random ids (``LLM.generate`` reuses no
prefix), and 16 sequences decoded together (``Lockstep``), their tok/s. The tokens of
both sides must be equal (the compiled combine is bit for bit torch's), or the bench fails.
Writes bench/results/cpu_combine.json and .png; prints a table.
"""
from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import report  # noqa: E402
from fused_cpu_decode import PROMPT, arguments, each_model, lockstep  # noqa: E402
from hardware import describe  # noqa: E402

SIDES = ("compiled", "torch")


def prefill(llm, ids: list[int]) -> tuple[float, list[int]]:
    from freetoken_engine import SamplingParams
    t0 = time.perf_counter()
    got = llm.generate(ids, SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True))
    return time.perf_counter() - t0, got.token_ids


def measure(name: str, folder: Path, dtype: str, args) -> dict:
    from freetoken_engine import LLM
    from freetoken_engine.kernels.cpu.combine import moe_combine
    from freetoken_engine.kernels.reference import moe_combine_forward
    from freetoken_engine.layers import moe
    llm = LLM(folder, dtype=dtype)
    short = llm.tokenizer.encode(PROMPT) if llm.tokenizer else list(range(11, 43))
    rng = random.Random(0)
    vocab = min(llm.runner.mcfg.vocab_size, 32000)
    prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
    ttft = {s: [] for s in SIDES}
    rate = {s: [] for s in SIDES}
    tokens = {}
    prefill(llm, prompt[:64])                               # warm: the kernels' library, the pool
    for r in range(args.rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            moe.moe_combine = moe_combine if side == "compiled" else moe_combine_forward
            try:
                s, first = prefill(llm, prompt)             # LLM.generate reuses no prefix
                rotated = [short[i % len(short):] + short[:i % len(short)] + [11 + i] for i in range(16)]
                b16, toks = lockstep(llm, rotated, args.tokens)
            finally:
                moe.moe_combine = moe_combine
            ttft[side].append(s)
            rate[side].append(b16)
            if tokens.setdefault(r, (first, toks)) != (first, toks):
                raise SystemExit(f"{name}: the two combines' tokens differ")
    return {"model": name, "dtype": dtype,
            "prefill_s": {s: statistics.median(ttft[s]) for s in SIDES},
            "prefill_ratio": statistics.median(t / c for c, t in zip(ttft["compiled"], ttft["torch"])),
            "batch16_tok_s": {s: statistics.median(rate[s]) for s in SIDES},
            "batch16_ratio": statistics.median(c / t for c, t in zip(rate["compiled"], rate["torch"])),
            "rounds": {"prefill_s": ttft, "batch16_tok_s": rate}}


def run(args) -> dict:
    rows = each_model(args, measure)
    print(f"\n{'model':18} {'prefill compiled':>17} {'torch':>8} {'speed-up':>9} {'b16 compiled':>13} {'torch':>8} "
          f"{'ratio':>6}")
    for r in rows:
        p, b = r["prefill_s"], r["batch16_tok_s"]
        print(f"{r['model']:18} {p['compiled']:15.2f} s {p['torch']:6.2f} s {r['prefill_ratio']:8.2f}x "
              f"{b['compiled']:13.1f} {b['torch']:8.1f} {r['batch16_ratio']:5.2f}x")
    print(f"prefill: {args.prompt_tokens} tokens to the first token; b16: 16 sequences' decode tok/s; medians of "
          f"{args.rounds} rounds, ratios the median of the rounds'; the same tokens on both sides")
    return {"benchmark": "cpu_combine", "hardware": describe(), "rounds": args.rounds,
            "prompt_tokens": args.prompt_tokens, "decode_tokens": args.tokens, "rows": rows, "tokens_equal": True}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    x = range(len(rows))
    for ax, key, label in ((axes[0], "prefill_s", f"time to first token, {result['prompt_tokens']}-token prompt (s)"),
                           (axes[1], "batch16_tok_s", "16 sequences' decode tok/s")):
        ax.bar([i - 0.2 for i in x], [r[key]["compiled"] for r in rows], 0.4, color="tab:green",
               label="compiled combine")
        ax.bar([i + 0.2 for i in x], [r[key]["torch"] for r in rows], 0.4, color="tab:gray", label="torch's ops")
        ax.set_xticks(list(x), [r["model"] for r in rows], fontsize=7, rotation=20)
        ax.set_ylabel(label, fontsize=8)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"MoE combine on the CPU, {result['hardware'].get('cpu', '')[:40]}, "
                 f"{result['hardware'].get('cores')} CPUs", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = arguments(__doc__, 3)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.set_defaults(tokens=32)
    report.main(ap, HERE / "results" / "cpu_combine.json", run, plot)


if __name__ == "__main__":
    main()
