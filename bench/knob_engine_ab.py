"""The CPU engine's decode speed under settings of the compiled kernel's knobs, in one process.

    python bench/knob_engine_ab.py [--settings "default; linear_far_pf=0"] [--rounds 5]
                                   [--dtypes float32,bfloat16] [--batches 1,4] [--tokens 32]
                                   [--label NAME]

A knob of ``cpu_experts.tune`` (tune.h) changes how the kernels read, never what they compute;
a bench of the kernel alone (``cpu_linear.py``, ``cpu_kernel_tune.py``) says how much faster a
call runs, this one what a user's decode gains. The checkpoint is ``cpu_generate.py``'s
``qwen3moe-bf16`` (Qwen3-30B-A3B's ratios at hidden 1024: 8 layers, 128 experts, top-8, a 32k
vocabulary, bfloat16 as published; ~320 MB read per token, about half of it dense projections
and the LM head), written to a temporary folder. Per engine dtype (float32, the CPU engine's
default, and bfloat16) one engine is loaded; then round after round each setting decodes
``--tokens`` greedy tokens at batch 1 (``generate``) and at batch 4 (four prompts in lockstep, as
``fused_cpu_decode.py``; its projections run 4 tokens a call), the settings alternating inside a
round so that drift touches them alike. Reported: decode tok/s of all sequences per round, the
median, each setting's median ratio to the first's over the rounds, and whether every setting
gave the same tokens (it must).
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
from fused_cpu_decode import batch1, batch4  # noqa: E402
from cpu_kernel_tune import parse_settings  # noqa: E402
from freetoken_engine import LLM  # noqa: E402
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


def decode_rounds(folder: Path, dtype: str, settings: dict, batches: list[int], rounds: int,
                  tokens: int) -> dict:
    """One engine in ``dtype``; per round, batch and setting a greedy decode (batch 1: ``generate``;
    batch 4: four prompts in lockstep, fused_cpu_decode.py's): {batch: {"tok_s": {setting: [...]},
    "same_tokens": bool}}."""
    llm = LLM(folder, dtype=dtype)
    prompt = list(range(3, 35))
    batch1(llm, prompt, 4)                                  # warm-up: the library, the pool
    defaults, threads = ce.tune(), ce.configure().threads
    runs = {1: batch1, 4: batch4}
    tok_s = {b: {name: [] for name in settings} for b in batches}
    ids: dict = {b: {} for b in batches}
    try:
        for _ in range(rounds):
            for b in batches:
                for name, knobs in settings.items():
                    ce.configure(threads=knobs.get("threads", threads))
                    ce.tune(**{k: v for k, v in knobs.items() if k != "threads"})
                    rate, ids[b][name] = runs[b](llm, prompt, tokens)
                    tok_s[b][name].append(rate)
                    ce.tune(**defaults)
    finally:
        ce.tune(**defaults)
        ce.configure(threads=threads)
        del llm
        gc.collect()
    first = next(iter(settings))
    return {b: {"tok_s": tok_s[b], "same_tokens": all(v == ids[b][first] for v in ids[b].values())}
            for b in batches}


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
        batches = [int(b) for b in args.batches.split(",")]
        for dtype in args.dtypes.split(","):
            for b, got in decode_rounds(folder, dtype, settings, batches, args.rounds, args.tokens).items():
                for name, per_round in got["tok_s"].items():
                    rows.append({"dtype": dtype, "batch": b, "setting": name, "tok_s": statistics.median(per_round),
                                 "rounds": per_round, "same_tokens": got["same_tokens"],
                                 "vs_first": statistics.median(x / y for x, y in zip(per_round, got["tok_s"][first]))})
            print(f"engine in {dtype} done", flush=True)
    print(f"\n{'dtype':9} {'batch':>5} {'setting':22} {'tok/s':>7} {'x ' + first:>12}  same tokens  rounds")
    for r in rows:
        print(f"{r['dtype']:9} {r['batch']:>5} {r['setting']:22} {r['tok_s']:7.1f} {r['vs_first']:12.3f}  "
              f"{str(r['same_tokens']):11}  " + " ".join(f"{v:.1f}" for v in r["rounds"]))
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
    cases = list(dict.fromkeys((r["dtype"], r.get("batch", 1)) for r in rows))
    fig, ax = plt.subplots(figsize=(max(5.5, 1.4 * len(cases)), 3.6))
    tok_s = {(r["setting"], (r["dtype"], r.get("batch", 1))): r["tok_s"] for r in rows}
    report.setting_bars(ax, cases, settings, lambda s, case: tok_s[(s, case)])
    ax.set_xticks(range(len(cases)), [f"engine in {d}\nbatch {b}" for d, b in cases])
    ax.set_ylabel("decode tok/s, all sequences (median)")
    report.finish_cpu_plot(fig, ax, result, f"CPU engine decode, {result['checkpoint']}, per kernel setting", path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="default; linear_far_pf=0",
                    help='kernel knobs per side, e.g. "default; linear_far_pf=0; threads=1" (cpu_experts.tune, '
                         "threads: the kernel's; the first is the ratios' base)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="the engine's compute dtypes")
    ap.add_argument("--batches", default="1,4", help="sequences decoded together: 1 and/or 4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens decoded per side and round")
    ap.add_argument("--label", default="this-machine")
    report.main(ap, HERE / "results" / "knob_engine_ab.json", run, plot)
