"""A decode-sized expert call against a plain read of the same bytes, and the Python call around it.

    python bench/expert_call_size.py [--experts 1,2,4,8] [--calls 48] [--rounds 3] [--label NAME]
                                     [--settings "default; chunks_per_thread=2"]

The GPU offload path's CPU branch computes a layer's 1-3 missed experts a call (9.4 MB each in
Qwen3-30B-A3B's shape: H 2048, I 768, bf16), where a CPU-only decode step computes 8. A small
call pays fixed costs (waking the kernel's threads, each thread's streams starting cold, the
hand-over from the gate/up rows to the down rows, the last chunk's tail) on fewer bytes. This
bench asks how much of that is the memory system's own: for each call size n (one token on n
experts, every call on experts no earlier call read: the bank is at least 8x the LLC), in the
same process, round after round:

- **read**: the kernel's threads reading n experts' bytes (one contiguous span the size of the
  call, never read before in the round) in chunks of the size an expert call hands out
  (``chunk_bytes``: a thread's share of the gate/up rows over ``chunks_per_thread``), so the
  read pays the same thread wake-up and the same stream starts;
- **from C**: the kernel's calls timed inside C, one at a time (``cpu_experts.calls_seconds``,
  as the engine's C++ branch and the calibration call it: no Python around the call);
- **through Python**: the same calls one ``experts_forward`` call each, writing a preallocated
  output (``out=``), with the kernel's phases of each call (``last_timing``: posted, the last
  thread started, the gate/up rows done, the end).

GB/s are bytes of experts read per second; "of read" is the kernel's rate over the read's for the
same call size (medians over rounds); the Python call around a call is its through-Python time
minus its from-C time. Writes bench/results/expert_call_size.json and .png; prints a table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import report  # noqa: E402
from cpu_expert_kernel import bank_tensor, hardware  # noqa: E402
from cpu_kernel_tune import parse_settings  # noqa: E402
from freetoken_engine.kernels import cpu_experts as ce  # noqa: E402

H, I = 2048, 768
EXPERT_BYTES = 3 * H * I * 2


def chunk_bytes(total: int, threads: int) -> int:
    """tune.h ``chunk_bytes`` of ``total`` bytes (over the ``chunks_per_thread`` knob's chunks a
    thread, 16 KiB-4 MiB), rounded to 4 KiB: the chunk a kernel call hands out."""
    c = total // (ce.tune()["chunks_per_thread"] * threads)
    return max(16384, min(4 << 20, c)) // 4096 * 4096


def read_chunk(call_bytes: int, threads: int) -> int:
    """The chunk an expert call of ``call_bytes`` hands out on its gate/up rows (2/3 of its bytes)."""
    return chunk_bytes(2 * call_bytes // 3, threads)


def measure(w13: torch.Tensor, w2: torch.Tensor, n: int, calls: int, start: int, threads: int,
            x_dtype: torch.dtype = torch.bfloat16) -> tuple[dict, int]:
    """One round of call size n: the read, then the calls from C, then through Python, each on
    experts the others (and the last few GB of this run) did not touch, from expert ``start`` on;
    -> (measurements, the next round's start)."""
    E = w2.shape[0]
    nbytes = n * EXPERT_BYTES
    span = nbytes * calls                        # the read side: this many bytes of w13 from `start`
    w13_bytes = 2 * I * H * 2
    if (start + -(-span // w13_bytes) + 2 * n * calls) > E:
        start = 0
    flat = w13.view(-1).view(torch.uint8)[start * w13_bytes:]
    ce.tune(read_chunk=read_chunk(nbytes, threads))
    read_s = [ce.read_seconds(flat[c * nbytes:(c + 1) * nbytes]) for c in range(calls)]
    ce.tune(read_chunk=1 << 20)
    first = start + -(-span // w13_bytes)
    x = (torch.randn(1, H) * 0.1).to(x_dtype)
    tok = torch.zeros(n, dtype=torch.int64)
    exps_c = torch.arange(first, first + n * calls).view(calls, n)
    exps_py = exps_c + n * calls
    out = torch.empty(n, H, dtype=x_dtype)
    from_c = statistics.median(ce.calls_seconds(x, w13, w2, tok, exps_c[c:c + 1]) for c in range(calls))
    py, phases = [], []
    for c in range(calls):
        t0 = time.perf_counter()
        ce.experts_forward(x, w13, w2, tok, exps_py[c], out=out)
        py.append(time.perf_counter() - t0)
        phases.append(ce.last_timing())
    med = statistics.median
    return ({"read_gbps": nbytes / med(read_s) / 1e9, "from_c_gbps": nbytes / from_c / 1e9,
             "python_gbps": nbytes / med(py) / 1e9, "from_c_us": from_c * 1e6, "python_us": med(py) * 1e6,
             "phases_us": {k: med(p[k] for p in phases) for k in phases[0]}},
            first + 2 * n * calls)


def run(args) -> dict:
    hw = hardware()
    llc = hw["llc_bytes"] or 32 << 20
    E = max(768, -(-8 * llc // EXPERT_BYTES))
    E = min(E, int(0.4 * hw["ram_bytes"] // EXPERT_BYTES)) // 128 * 128
    threads = ce.configure().threads
    print(f"{hw['cpu_model']} | {hw['cpus']} CPUs | LLC {llc >> 20} MiB | bank {E} experts, "
          f"{E * EXPERT_BYTES / 1e9:.1f} GB | kernel {ce.backend_name()}, {threads} threads")
    w13, w2 = bank_tensor(E, 2 * I, H), bank_tensor(E, H, I)
    sizes = [int(s) for s in args.experts.split(",")]
    settings = dict(parse_settings(args.settings))
    defaults = ce.tune()
    rounds: dict[tuple[str, int], list[dict]] = {(name, n): [] for name in settings for n in sizes}
    x_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.x_dtype]
    # warm-up, a second of calls: on a VM a worker that slept joins the first calls late
    # (pool_entries: about a third of the first 36 jobs on the 2-CPU VM), halving those reads
    t0, start = time.perf_counter(), 0
    while time.perf_counter() - t0 < 1.0:
        _, start = measure(w13, w2, sizes[0], 8, start, threads, x_dtype)
    for r in range(args.rounds):
        for name, knobs in settings.items():
            th = knobs.get("threads", threads)
            ce.configure(threads=th)
            ce.tune(**{k: v for k, v in knobs.items() if k != "threads"})
            for n in sizes:
                got, start = measure(w13, w2, n, max(4, args.calls // n), start, th, x_dtype)
                rounds[(name, n)].append(got)
            ce.tune(**defaults)
            ce.configure(threads=threads)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    rows = []
    med = statistics.median
    for (name, n), rs in rounds.items():
        row = {"setting": name, "experts": n, "call_mb": n * EXPERT_BYTES / 1e6,
               **{k: med(r[k] for r in rs)
                  for k in ("read_gbps", "from_c_gbps", "python_gbps", "from_c_us", "python_us")},
               "phases_us": {k: med(r["phases_us"][k] for r in rs) for k in rs[0]["phases_us"]},
               "rounds": rs}
        row["from_c_of_read"] = med(r["from_c_gbps"] / r["read_gbps"] for r in rs)
        row["python_of_read"] = med(r["python_gbps"] / r["read_gbps"] for r in rs)
        row["python_around_call_us"] = row["python_us"] - row["from_c_us"]
        rows.append(row)
    print(f"\n{'setting':24} {'experts':>7} {'MB':>6} {'read':>7} {'from C':>7} {'Python':>7} {'C/read':>7} "
          f"{'Py/read':>7} {'C us':>7} {'Py us':>7} {'Py +us':>7}  "
          "phases (posted / last start / gate-up done / end, us)")
    for w in rows:
        ph = w["phases_us"]
        print(f"{w['setting']:24} {w['experts']:>7} {w['call_mb']:6.1f} {w['read_gbps']:7.1f} {w['from_c_gbps']:7.1f} "
              f"{w['python_gbps']:7.1f} {w['from_c_of_read']:7.2f} {w['python_of_read']:7.2f} {w['from_c_us']:7.1f} "
              f"{w['python_us']:7.1f} {w['python_around_call_us']:7.1f}  {ph['posted']:.1f} / {ph['last_start']:.1f} / "
              f"{ph['stage1_end']:.1f} / {ph['end']:.1f}")
    print("GB/s of expert bytes; read: the same bytes read by the kernel's threads in the call's chunks; "
          "medians over rounds (the ratios: of each round's pair)")
    return {"benchmark": "expert_call_size", "label": args.label, "hardware": hw, "threads": threads,
            "backend": ce.backend_name(), "expert_calls_per_round": args.calls, "rounds": args.rounds,
            "x_dtype": args.x_dtype, "settings": settings, "defaults": defaults, "method": __doc__, "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    xs = range(len(rows))
    multi = len({r["setting"] for r in rows}) > 1
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 3.8))
    for i, (key, name, color) in enumerate((("read_gbps", "read, same bytes", "tab:gray"),
                                            ("from_c_gbps", "kernel from C", "tab:green"),
                                            ("python_gbps", "kernel through Python", "tab:blue"))):
        ax.bar([x + (i - 1) * 0.27 for x in xs], [r[key] for r in rows], 0.27, label=name, color=color)
    ax.set_xticks(list(xs), [f"{r['experts']} expert{'s' if r['experts'] > 1 else ''}\n{r['call_mb']:.0f} MB"
                             + (f"\n{r['setting']}" if multi else "") for r in rows], fontsize=6 if multi else 8)
    ax.set_ylabel("GB/s of expert bytes")
    report.finish_cpu_plot(fig, ax, result, f"One {result.get('x_dtype', 'bfloat16')} token's expert call vs "
                           "a read of its bytes", path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", default="1,2,4,8", help="call sizes: experts a call, one token")
    ap.add_argument("--calls", type=int, default=48,
                    help="experts' worth of calls of each size a round (calls // n calls of n)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--label", default="this-machine")
    ap.add_argument("--x-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the token's dtype (a CPU engine computes in float32 by default: its bf16 experts "
                         "then take the fp32-token path)")
    ap.add_argument("--settings", default="default",
                    help='kernel tuning knobs per side, e.g. "default; chunks_per_thread=2; threads=16" '
                         '(cpu_experts.tune; threads: the kernel\'s participants)')
    report.main(ap, HERE / "results" / "expert_call_size.json", run, plot)
