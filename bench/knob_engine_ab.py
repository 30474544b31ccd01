"""The CPU engine's decode speed under settings of the compiled kernel's knobs, in one process.

    python bench/knob_engine_ab.py [--settings "default; linear_far_pf=0"] [--rounds 5]
                                   [--dtypes float32,bfloat16] [--tokens 32] [--label NAME]

A knob of ``cpu_experts.tune`` (tune.h) changes how the kernels read, never what they compute;
a bench of the kernel alone (``cpu_linear.py``, ``cpu_kernel_tune.py``) says how much faster a
call runs, this one what a user's decode gains. The checkpoint is ``cpu_generate.py``'s
``qwen3moe-bf16`` (Qwen3-30B-A3B's ratios at hidden 1024: 8 layers, 128 experts, top-8, a 32k
vocabulary, bfloat16 as published; ~320 MB read per token, about half of it dense projections
and the LM head), written to a temporary folder. Per engine dtype (float32, the CPU engine's
default, and bfloat16) one engine is loaded; then round after round each setting decodes
``--tokens`` greedy tokens of the same prompt (the settings alternate inside a round, so drift
touches them alike). Reported: decode tok/s per round, the median, each setting's median ratio
to the first's over the rounds, and whether every setting gave the same tokens (it must).
Writes bench/results/knob_engine_ab.json and .png; prints a table.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import report  # noqa: E402
from cpu_expert_kernel import hardware  # noqa: E402
from cpu_generate import CHECKPOINTS  # noqa: E402
from cpu_kernel_tune import parse_settings  # noqa: E402
from freetoken_engine import LLM, SamplingParams  # noqa: E402
from freetoken_engine.kernels import cpu_experts as ce  # noqa: E402
from tiny_models import make_tiny_checkpoint  # noqa: E402

CHECKPOINT = "qwen3moe-bf16"


def write_checkpoint(tmp: Path) -> Path:
    spec = CHECKPOINTS[CHECKPOINT]
    torch.set_default_dtype(torch.bfloat16)              # written in its dtype, as cpu_generate's
    try:
        return make_tiny_checkpoint(tmp, "qwen3_moe", vocab_size=spec["vocab_size"], dtype=spec["dtype"],
                                    **spec["shape"])
    finally:
        torch.set_default_dtype(torch.float32)


def decode_rounds(folder: Path, dtype: str, settings: dict, rounds: int, tokens: int) -> dict:
    """One engine in ``dtype``; per round, every setting's greedy decode: tok/s lists and tokens."""
    llm = LLM(folder, dtype=dtype)
    prompt = list(range(3, 35))
    params = SamplingParams(max_new_tokens=tokens + 1, temperature=0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))   # warm-up
    defaults, threads = ce.tune(), ce.configure().threads
    tok_s = {name: [] for name in settings}
    ids = {}
    try:
        for _ in range(rounds):
            for name, knobs in settings.items():
                ce.configure(threads=knobs.get("threads", threads))
                ce.tune(**{k: v for k, v in knobs.items() if k != "threads"})
                out = llm.generate(prompt, params)
                tok_s[name].append(out.stats["decode_tokens_per_s"])
                ids[name] = out.token_ids
                ce.tune(**defaults)
    finally:
        ce.tune(**defaults)
        ce.configure(threads=threads)
        del llm
        gc.collect()
    first = next(iter(settings))
    return {"tok_s": tok_s, "same_tokens": all(v == ids[first] for v in ids.values())}


def run(args) -> dict:
    if not ce.available():
        raise SystemExit("the compiled CPU kernel is unavailable (no C++ compiler?)")
    hw = hardware()
    settings = dict(parse_settings(args.settings))
    first = next(iter(settings))
    threads = ce.configure().threads
    print(f"{hw['cpu_model']} | {hw['cpus']} CPUs | kernel {ce.backend_name()}, {threads} threads")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folder = write_checkpoint(Path(tmp))
        print(f"{CHECKPOINT}: written in {time.perf_counter() - t0:.0f} s", flush=True)
        for dtype in args.dtypes.split(","):
            got = decode_rounds(folder, dtype, settings, args.rounds, args.tokens)
            for name, per_round in got["tok_s"].items():
                rows.append({"dtype": dtype, "setting": name, "tok_s": statistics.median(per_round),
                             "rounds": per_round, "same_tokens": got["same_tokens"],
                             "vs_first": statistics.median(a / b for a, b in zip(per_round, got["tok_s"][first]))})
            print(f"engine in {dtype} done", flush=True)
    print(f"\n{'dtype':9} {'setting':22} {'tok/s':>7} {'x ' + first:>12}  same tokens  rounds")
    for r in rows:
        print(f"{r['dtype']:9} {r['setting']:22} {r['tok_s']:7.1f} {r['vs_first']:12.3f}  {str(r['same_tokens']):11}  "
              + " ".join(f"{v:.1f}" for v in r["rounds"]))
    return {"benchmark": "knob_engine_ab", "label": args.label, "hardware": hw, "threads": threads,
            "backend": ce.backend_name(), "checkpoint": CHECKPOINT, "checkpoint_spec": CHECKPOINTS[CHECKPOINT],
            "decode_tokens": args.tokens, "rounds": args.rounds, "settings": settings, "method": __doc__,
            "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    settings = list(result["settings"])
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    tok_s = {(r["setting"], r["dtype"]): r["tok_s"] for r in rows}
    report.setting_bars(ax, dtypes, settings, lambda s, d: tok_s[(s, d)])
    ax.set_xticks(range(len(dtypes)), [f"engine in {d}" for d in dtypes])
    ax.set_ylabel("decode tok/s (median of rounds)")
    report.finish_cpu_plot(fig, ax, result, f"CPU engine decode, {result['checkpoint']}, per kernel setting", path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="default; linear_far_pf=0",
                    help='kernel knobs per side, e.g. "default; linear_far_pf=0; threads=1" (cpu_experts.tune, '
                         "threads: the kernel's; the first is the ratios' base)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="the engine's compute dtypes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens decoded per side and round")
    ap.add_argument("--label", default="this-machine")
    report.main(ap, HERE / "results" / "knob_engine_ab.json", run, plot)
