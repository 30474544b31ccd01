"""Benchmark: torch's threads during a CPU engine's decode passes (``executor/host_threads.py``).

    python bench/host_threads.py [--rounds 2] [--only qwen3moe-bf16,...]

The sides, in one process and one engine per model, alternating which goes first each round:
``one thread`` (the engine's default: decode passes of at most 8 rows run torch's own ops on one
thread, and the sampler after them too, until the call returns), ``per pass`` (the same, the
count put back after each pass, so the sampler runs on all threads) and ``torch's threads``
(torch left alone: what the engine did before). Batch 1 (greedy ``generate``) and batch 4
(``Lockstep``), the models of ``bench/fused_cpu_decode.py``. Run it without
``OMP_WAIT_POLICY`` set (a program that imports torch before the engine gets that; the CLI sets
``PASSIVE``) and with ``OMP_WAIT_POLICY=PASSIVE``: the label records which. The tokens of every
side must be equal, or the bench fails. Writes bench/results/host_threads.json and .png.
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

#: the variable as torch's OpenMP runtime reads it when torch loads (next line); importing the
#: engine later sets it to PASSIVE, too late for that runtime
POLICY = os.environ.get("OMP_WAIT_POLICY", "unset")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import report  # noqa: E402
from fused_cpu_decode import PROMPT, arguments, batch1, batch4, each_model  # noqa: E402
from hardware import describe  # noqa: E402

SIDES = ("one thread", "per pass", "torch's threads")


def measure(name: str, folder: Path, dtype: str, args) -> dict:
    from freetoken_engine import LLM
    from freetoken_engine.executor.host_threads import HostThreads
    llm = LLM(folder, dtype=dtype)
    ids = llm.tokenizer.encode(PROMPT) if llm.tokenizer else list(range(11, 43))
    if llm.runner.host_threads is None:
        raise SystemExit("the compiled CPU kernels did not load: torch keeps its threads, nothing to compare")
    batch1(llm, ids, 8)                          # warm: the kernels' library, the pool
    full = llm.runner.host_threads.full
    sides = {"one thread": llm.runner.host_threads, "per pass": HostThreads(full, sticky=False),
             "torch's threads": None}
    rates = {(s, b): [] for s in SIDES for b in (1, 4)}
    tokens = {}
    for r in range(args.rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            llm.runner.host_threads = sides[side]
            for b, fn in ((1, batch1), (4, batch4)):
                rate, toks = fn(llm, ids, args.tokens if b == 1 else args.tokens // 4)
                rates[side, b].append(rate)
                if tokens.setdefault((b, r), toks) != toks:
                    raise SystemExit(f"{name}: the tokens of '{side}' differ at batch {b}")
            if torch.get_num_threads() != full:
                raise SystemExit(f"{name}: '{side}' left torch at {torch.get_num_threads()} threads, not {full}")
    row = {"model": name, "dtype": dtype, "torch_threads": full}
    for b in (1, 4):
        base = rates["torch's threads", b]
        row[f"batch{b}"] = {s: {"tok_s": statistics.median(rates[s, b]), "rounds": rates[s, b],
                                "ratio": statistics.median(x / y for x, y in zip(rates[s, b], base))} for s in SIDES}
    return row


def run(args) -> dict:
    rows = each_model(args, measure)
    policy = POLICY
    print(f"\nOMP_WAIT_POLICY {policy}; tok/s (ratio to torch's threads: the median of the rounds' ratios)")
    print(f"{'model':18} {'batch':>5} " + " ".join(f"{s:>22}" for s in SIDES))
    for r in rows:
        for b in (1, 4):
            cells = [f"{r[f'batch{b}'][s]['tok_s']:9.1f} ({r[f'batch{b}'][s]['ratio']:4.2f}x)" for s in SIDES]
            print(f"{r['model']:18} {b:>5} " + " ".join(f"{c:>22}" for c in cells))
    return {"benchmark": "host_threads", "hardware": describe(), "omp_wait_policy": policy,
            "rounds": args.rounds, "decode_tokens": args.tokens, "rows": rows, "tokens_equal": True}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = [f"{r['model']}\nbatch {b}" for r in rows for b in (1, 4)]
    x = range(len(labels))
    for k, (side, color) in enumerate(zip(SIDES, ("tab:green", "tab:olive", "tab:gray"))):
        ax.bar([i + (k - 1) * 0.27 for i in x], [r[f"batch{b}"][side]["tok_s"] for r in rows for b in (1, 4)],
               0.27, color=color, label=side)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("decode tok/s")
    hw = result["hardware"]
    ax.set_title(f"CPU decode, torch's threads per pass; {hw.get('cpu', '')[:32]}, {hw.get('cores')} CPUs, "
                 f"OMP_WAIT_POLICY {result['omp_wait_policy']}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    report.main(arguments(__doc__, 2), HERE / "results" / "host_threads.json", run, plot)

if __name__ == "__main__":
    main()
