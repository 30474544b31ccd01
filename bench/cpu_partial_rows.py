"""What a partial expert costs the CPU kernel: calls on the intermediate rows [r, I) only.

The streamed split (kernels/triton/stream.py) sends an expert's first r intermediate rows over
PCIe to the GPU and leaves rows [r, I) to the CPU, expecting the CPU's time to fall with its
share of the rows. The gate/up rows [r, I) are contiguous, but the down projection reads columns
[r, I) of W2 [H, I]: every one of its H rows loses a piece at its start, and the memory system
may fetch the skipped lines anyway (hardware prefetchers stream whole rows). This measures it:
1-expert calls from C (``cpu_experts.calls_seconds``, as the engine's C++ branch calls the
kernel) on a Qwen3-30B-A3B-shaped bf16 bank larger than the last-level cache, each r in its own
round, rounds repeated and alternated; reported as time against the whole expert's, next to the
bytes the rows need (W13 rows + W2 pieces) and the bytes if W2's rows are read whole.

    python bench/cpu_partial_rows.py [--rounds 3] [--out bench/results]

Writes OUT/cpu_partial_rows.json and a PNG, hardware named.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_expert_kernel import H, I, RESULTS, bank_tensor, hardware, write_results  # noqa: E402
from freetoken_engine.kernels import cpu_experts as ce  # noqa: E402

GRANULE = 64            # the streamed split's row granule (DeviceControl.set_stream)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=96, help="1-expert calls per measurement")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not ce.available():
        sys.exit("needs the compiled CPU kernel")
    hw = hardware()
    ebytes = 3 * H * I * 2
    llc = hw["llc_bytes"] or 32 << 20
    E = min(max(256, -(-8 * llc // ebytes)), int(0.3 * hw["ram_bytes"] // ebytes))
    w13, w2 = bank_tensor(E, 2 * I, H), bank_tensor(E, H, I)
    x, tok = torch.randn(1, H).to(torch.bfloat16), torch.zeros(1, dtype=torch.int64)
    starts = list(range(0, I, GRANULE))
    gen = torch.Generator().manual_seed(0)
    times: dict[int, list[float]] = {r: [] for r in starts}
    for rnd in range(args.rounds):
        order = starts if rnd % 2 == 0 else starts[::-1]
        for r in order:
            exps = torch.randperm(E, generator=gen)[:args.calls].view(-1, 1)
            ce.calls_seconds(x, w13, w2, tok, exps[:1], rows_from=r)          # wake the pool
            times[r].append(ce.calls_seconds(x, w13, w2, tok, exps, rows_from=r) / args.calls)
    whole = statistics.median(times[0])
    rows = []
    print(f"{hw['cpu_model']} | {ce.backend_name()} | {ce.default_threads()} threads | bank {E} experts\n"
          f"{'rows':>10s} {'share':>6s} {'us/call':>8s} {'time / whole':>13s} {'bytes needed':>13s} {'W2 whole':>9s}")
    for r in starts:
        share = (I - r) / I
        t = statistics.median(times[r])
        need = (2 * share * H * I + H * share * I) * 2 / ebytes      # W13 rows + W2 row pieces
        full_w2 = (2 * share * H * I + H * I) * 2 / ebytes           # W2 rows read whole
        rows.append({"rows_from": r, "row_share": share, "us_per_call": 1e6 * t, "time_vs_whole": t / whole,
                     "bytes_needed_vs_whole": need, "bytes_if_w2_rows_whole": full_w2,
                     "us_per_call_rounds": [1e6 * v for v in times[r]]})
        print(f"{f'[{r}, {I})':>10s} {share:6.2f} {1e6 * t:8.1f} {t / whole:13.2f} {need:13.2f} {full_w2:9.2f}")
    data = {"benchmark": "cpu_partial_rows", "method": __doc__.strip().split("\n\n")[0], "hardware": hw,
            "threads": ce.default_threads(), "backend": ce.backend_name(), "bank_experts": E,
            "rounds": args.rounds, "calls": args.calls, "rows": rows}
    write_results(args.out / f"cpu_partial_rows_{hw['cpus']}cpu.json", data, plot)


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = data["rows"]
    share = [r["row_share"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(share, [r["time_vs_whole"] for r in rows], "o-", label="measured time / whole expert")
    ax.plot(share, [r["bytes_needed_vs_whole"] for r in rows], "--", label="bytes the rows need")
    ax.plot(share, [r["bytes_if_w2_rows_whole"] for r in rows], ":", label="bytes if W2 rows are read whole")
    ax.set_xlabel("share of the intermediate rows the CPU computes")
    ax.set_ylabel("relative to the whole expert")
    ax.set_title(f"partial experts on the CPU: {data['hardware']['cpu_model']}, {data['threads']} threads", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
