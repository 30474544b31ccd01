"""CPU expert kernel vs PyTorch vs STREAM-style read, on expert rows larger than the LLC.

Workload: a bank of E experts in the Qwen3-30B-A3B expert shape (H 2048, I 768, bf16, 9.4 MB
each), allocated like the engine's (page-aligned, ``packed.memory.aligned_empty``), E chosen so
the bank is at least 8x the last-level cache and 6 layers of 128 experts; each call is one MoE
layer's decode step whose experts are the next ones of a fixed permutation, so no call finds its
weights in cache. GB/s = bytes of distinct experts' weights read per second.

Cases: one token on 8 experts (bf16 and fp32 x), one token on 1 and on 2 experts (the GPU
offload path's calls), 4 and 8 tokens each over a random top-8 of 32 / 64 experts (about one
token per expert, as a decode batch routes: denser than 8 tokens over 128 experts), 4 and 8
tokens all on the same
8 experts (on an AMX CPU also with the tiles off, ``isa=avx512bf16``); and the static layer split
of bench/offload_decode.py (``_static_token``): per layer of 128 experts, 4 tokens with uniform
random top-8 (~29 experts, most with one token) or 1 token, the kernel's result copied by torch
into a preallocated buffer as that benchmark does, or written in place (``out=``), or neither.

Sides, interleaved round by round in the same run: the compiled kernel
(``cpu_experts.experts_forward``) at its default thread count and at all CPUs, PyTorch's path
(``reference.expert_pairs_forward``, torch threads = all CPUs), and a STREAM-style read of the
same bank (vector loads; at every thread count the kernel runs with, and at all CPUs just before
and just after each kernel batch). Best and median of the rounds, and for the kernel the median
over rounds of kernel / (all-CPU read measured around it): the headline, robust to other jobs
sharing the machine.

    python bench/cpu_expert_kernel.py --label cpu-2core [--rounds 5] [--quick] [--out DIR] [--tune KNOB=N,...]

Merges this machine's entry into bench/results/cpu_expert_kernel.json (or DIR's copy; other
machines' entries are kept) and redraws the .png next to it from every entry.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from freetoken_engine.kernels import cpu_experts as ce
from freetoken_engine.kernels.reference import expert_pairs_forward
from freetoken_engine.packed.memory import arena, as_tensor

RESULTS = Path(__file__).resolve().parent / "results"
H, I, K = 2048, 768, 8            # Qwen3-30B-A3B: hidden, expert intermediate, top-k
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def hardware() -> dict:
    """CPU model, CPU count, ISA flags, LLC and RAM of this machine (Linux)."""
    info = {"cpu_model": platform.processor() or "?", "flags": [], "llc_bytes": None}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and info["cpu_model"] in ("?", "x86_64", ""):
                info["cpu_model"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                info["flags"] = [f for f in FLAGS if f in have]
                break
    except OSError:
        pass
    for idx in range(8):
        base = Path(f"/sys/devices/system/cpu/cpu0/cache/index{idx}")
        if (base / "level").exists() and (base / "level").read_text().strip() == "3":
            s = (base / "size").read_text().strip()
            info["llc_bytes"] = int(s[:-1]) * 1024 if s.endswith("K") else int(s)
    info["cpus"] = len(os.sched_getaffinity(0))
    info["ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    info["torch"] = torch.__version__
    info["loadavg_1m"] = os.getloadavg()[0]   # other work on the machine while measuring
    try:
        info["gxx"] = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        info["gxx"] = None
    return info


@functools.lru_cache(maxsize=1)
def fill_block() -> torch.Tensor:
    """The random bf16 block that bank_tensor tiles."""
    return (torch.rand(1 << 26) * 0.1 - 0.05).to(torch.bfloat16)


def bank_tensor(*shape: int, huge: bool | None = None) -> torch.Tensor:
    """A bf16 tensor in page-aligned memory as the engine allocates its bank, filled by tiling
    one random block (contents do not change any timing; uniform_ over gigabytes is slow).
    ``huge``: ``packed.memory.arena``'s (None: the engine's default, huge pages)."""
    n = 1
    for d in shape:
        n *= d
    t = as_tensor(arena(2 * n, huge=huge), 2 * n).view(torch.bfloat16)
    block = fill_block()
    for i in range(0, n, block.numel()):
        t[i:i + block.numel()].copy_(block[:n - i])
    return t.view(*shape)


def make_plans(E: int, T: int, mode: str, gen: torch.Generator) -> list[tuple]:
    """Calls covering the bank once: (tok, exp, distinct_experts) per call."""
    perm = torch.randperm(E, generator=gen)
    plans = []
    window = {"1_expert": 1, "2_experts": 2, "random_top8": T * K}.get(mode, K)
    for s in range(0, E - window + 1, window):
        w = perm[s:s + window]
        if mode in ("one_token", "1_expert", "2_experts"):   # T = 1: one token on each expert
            tok, exp = torch.zeros(window, dtype=torch.long), w
        elif mode == "same_experts":     # T tokens all routed to the same 8 experts
            tok, exp = torch.arange(T).repeat_interleave(K), w.repeat(T)
        else:                            # T tokens, each top-8 of a window of T * 8 experts
            tok = torch.arange(T).repeat_interleave(K)
            exp = torch.cat([w[torch.randperm(window, generator=gen)[:K]] for _ in range(T)])
        plans.append((tok, exp, int(torch.unique(exp).numel())))
    return plans


def static_plans(E: int, T: int, layers: int, calls: int, gen: torch.Generator) -> list[tuple]:
    """offload_decode._static_token's calls: (layer, tok, exp, distinct) per MoE layer of a CPU
    layer range; every token routes to a uniform random top-8 of the layer's 128 experts."""
    plans = []
    for c in range(calls):
        ids = torch.stack([torch.randperm(128, generator=gen)[:K] for _ in range(T)])   # [T, k]
        plans.append((c % layers, torch.arange(T).repeat_interleave(K), ids.reshape(-1),
                      int(torch.unique(ids).numel())))
    return plans


def static_gbps(w13l, w2l, x, plans, mode: str, min_s: float, ebytes: int) -> float:
    """GB/s of the static split's per-layer calls; mode: "copy" (torch copies the result into a
    preallocated buffer, as offload_decode does), "out" (the kernel writes it: out=), "plain"."""
    buf = torch.empty(x.shape[0] * K, H, dtype=x.dtype)
    n, nbytes, t0 = 0, 0, time.perf_counter()
    while True:
        layer, tok, exp, d = plans[n % len(plans)]
        if mode == "out":
            ce.experts_forward(x, w13l[layer], w2l[layer], tok, exp, out=buf)
        elif mode == "copy":
            buf.copy_(ce.experts_forward(x, w13l[layer], w2l[layer], tok, exp))
        else:
            ce.experts_forward(x, w13l[layer], w2l[layer], tok, exp)
        n, nbytes = n + 1, nbytes + d * ebytes
        dt = time.perf_counter() - t0
        if n >= 3 and dt >= min_s:
            return nbytes / dt / 1e9


def gbps(fn, x, w13, w2, plans, min_s: float, ebytes: int) -> float:
    """Weights' GB/s of fn over the plans (at least min_s seconds and 3 calls, whole calls)."""
    fn(x, w13, w2, *plans[-1][:2])  # wake the pool / allocator
    n, nbytes, t0 = 0, 0, time.perf_counter()
    while True:
        tok, exp, d = plans[n % len(plans)]
        fn(x, w13, w2, tok, exp)
        n, nbytes = n + 1, nbytes + d * ebytes
        dt = time.perf_counter() - t0
        if n >= 3 and dt >= min_s:
            return nbytes / dt / 1e9


def c_gbps(x, w13, w2, plans, min_s: float, ebytes: int) -> float:
    """Weights' GB/s of the same calls run back to back from C (``calls_seconds``), as the GPU
    decode's CPU branch and the calibration call the kernel: no Python call around each."""
    tok, exps = plans[0][0], torch.stack([p[1] for p in plans])
    per_pass = sum(p[2] for p in plans) * ebytes
    n, secs = 0, 0.0
    while n < 1 or secs < min_s:
        secs += ce.calls_seconds(x, w13, w2, tok, exps)
        n += 1
    return n * per_pass / secs / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default=platform.node())
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer cases (smoke run)")
    ap.add_argument("--prefetch", default="4096,0,512,1024,2048", help="prefetch distances to sweep (bytes); the first one is used for every case")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder of the JSON and PNG (default bench/results)")
    ap.add_argument("--tune", default="", metavar="KNOB=N,...",
                    help="kernel tuning knobs to run with (cpu_experts.tune), recorded in the entry; default: none")
    args = ap.parse_args()
    from cpu_kernel_tune import parse_settings      # (that module imports this one)
    tuned = parse_settings(args.tune)[0][1] if args.tune else {}
    ce.tune(**tuned)

    hw = hardware()
    ncpu = hw["cpus"]
    ebytes = 3 * H * I * 2
    llc = hw["llc_bytes"] or 32 << 20
    E = max(6 * 128, -(-8 * llc // ebytes))
    E = min(E, int(0.4 * hw["ram_bytes"] // ebytes)) // 128 * 128
    layers = E // 128
    print(f"{hw['cpu_model']} | {ncpu} CPUs | LLC {llc >> 20} MiB | flags {' '.join(hw['flags'])}")
    print(f"bank: {E} experts x {ebytes / 1e6:.2f} MB = {E * ebytes / 1e9:.2f} GB bf16 ({layers} layers of 128)")
    t0 = time.perf_counter()
    w13, w2 = bank_tensor(E, 2 * I, H), bank_tensor(E, H, I)
    w13l, w2l = w13.view(layers, 128, 2 * I, H), w2.view(layers, 128, H, I)
    print(f"filled in {time.perf_counter() - t0:.1f} s; kernel: {ce.backend_name()} {ce.cpu_features()}")
    torch.set_num_threads(ncpu)
    default_threads = ce.default_threads()
    pf_list = [int(p) for p in args.prefetch.split(",")]
    gen = torch.Generator().manual_seed(0)

    cases = [("one_token", 1, torch.bfloat16), ("one_token", 1, torch.float32),
             ("1_expert", 1, torch.bfloat16), ("2_experts", 1, torch.bfloat16),
             ("random_top8", 4, torch.bfloat16), ("random_top8", 8, torch.bfloat16),
             ("same_experts", 4, torch.bfloat16), ("same_experts", 8, torch.bfloat16)]
    if args.quick:
        cases = cases[:2]
    amx = ce.cpu_features().get("best_isa") == "amx"   # then also the same cases with the tiles off
    plans = {(m, T): make_plans(E, T, m, gen) for m, T, _ in cases}
    splans = {T: static_plans(E, T, layers, 64, gen) for T in (1, 4)}
    xs = {(T, dt): torch.randn(T, H).to(dt) for _, T, dt in cases}
    thread_set = sorted({default_threads, ncpu} | ({1} if ncpu <= 4 else set()))
    samples: dict[str, list[float]] = {}

    def add(key: str, v: float) -> None:
        samples.setdefault(key, []).append(v)

    ratios: dict[str, list[float]] = {}   # kernel / read of all CPUs measured around it

    def read_all_cpus() -> float:
        ce.configure(threads=ncpu, prefetch_bytes=0)
        v = w13.numel() * 2 / ce.read_seconds(w13) / 1e9
        add(f"read/threads={ncpu}", v)
        return v

    for r in range(args.rounds):
        for th in thread_set:
            before = read_all_cpus()
            ce.configure(threads=th, prefetch_bytes=0)
            if th != ncpu:
                add(f"read/threads={th}", w13.numel() * 2 / ce.read_seconds(w13) / 1e9)
            got = {}
            for pf in pf_list:
                ce.configure(prefetch_bytes=pf)
                for m, T, dt in cases:
                    if pf != pf_list[0] and m not in ("one_token", "same_experts"):
                        continue  # the prefetch sweep: one-token and many-token cases
                    v = gbps(ce.experts_forward, xs[(T, dt)], w13, w2, plans[(m, T)], 0.25, ebytes)
                    got[f"kernel/{m}/T={T}/x={str(dt)[6:]}/threads={th}/prefetch={pf}"] = v
            ce.configure(prefetch_bytes=pf_list[0])
            for m, T, dt in cases:      # the same calls from C: the engine's GPU path calls it so
                if dt == torch.bfloat16:
                    v = c_gbps(xs[(T, dt)], w13, w2, plans[(m, T)], 0.25, ebytes)
                    got[f"kernel/{m}/T={T}/x=bfloat16/threads={th}/prefetch={pf_list[0]}/from_c"] = v
            if amx:
                ce.configure(isa="avx512bf16")
                for m, T, dt in cases:
                    if m == "same_experts":
                        v = gbps(ce.experts_forward, xs[(T, dt)], w13, w2, plans[(m, T)], 0.25, ebytes)
                        got[f"kernel/{m}/T={T}/x={str(dt)[6:]}/threads={th}/prefetch={pf_list[0]}/isa=avx512bf16"] = v
                ce.configure(isa="auto")
            if not args.quick:
                for T, mode in ((4, "copy"), (4, "out"), (4, "plain"), (1, "copy")):
                    x = xs[(T, torch.bfloat16)]
                    got[f"kernel/static_split/T={T}/{mode}/threads={th}"] = static_gbps(w13l, w2l, x, splans[T], mode,
                                                                                      0.4, ebytes)
            after = read_all_cpus()
            for k, v in got.items():  # paired: robust to other jobs coming and going between rounds
                add(k, v)
                ratios.setdefault(k, []).append(v / (0.5 * (before + after)))
        if r < 2:  # PyTorch's path is slow; two rounds are enough to rank it
            for m, T, dt in cases:
                if m in ("1_expert", "2_experts") or (m, T) == ("same_experts", 4):
                    continue
                v = gbps(expert_pairs_forward, xs[(T, dt)], w13, w2, plans[(m, T)][:6], 0.5, ebytes)
                add(f"pytorch/{m}/T={T}/x={str(dt)[6:]}/threads={ncpu}", v)
        print(f"round {r + 1}/{args.rounds} done")

    summary = {k: {"best": max(v), "median": statistics.median(v), "samples": len(v)}
               for k, v in samples.items()}
    for k, v in ratios.items():
        summary[k]["paired_fraction_of_read_median"] = statistics.median(v)
    read_all = summary[f"read/threads={ncpu}"]["best"]   # the machine's read bandwidth
    print(f"\n{'side':70s} {'best GB/s':>10s} {'median':>8s} {'paired % of read':>17s}")
    for k, s in summary.items():
        frac = s.get("paired_fraction_of_read_median")
        print(f"{k:70s} {s['best']:10.1f} {s['median']:8.1f} {'' if frac is None else f'{100 * frac:16.0f}%'}")
    default_pf = ce.KernelConfig(threads=1).prefetch_bytes      # the kernel's default settings
    main_key = f"kernel/one_token/T=1/x=bfloat16/threads={default_threads}/prefetch={default_pf}"
    if main_key not in summary:
        main_key = f"kernel/one_token/T=1/x=bfloat16/threads={default_threads}/prefetch={pf_list[0]}"
    entry = {
        "hardware": hw, "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "kernel_backend": ce.backend_name(), "default_threads": default_threads, "tuning": ce.tune(),
        "tuned": tuned,
        "bank": {"experts": E, "layers_of_128": layers, "expert_bytes": ebytes, "total_bytes": E * ebytes,
                 "dtype": "bfloat16", "allocation": "packed.memory.aligned_empty"},
        "results_gbps": summary,
        "headline": {"kernel_key": main_key, "kernel_gbps": summary[main_key]["best"],
                     "read_gbps_all_cpus": read_all,
                     "fraction_of_read": summary[main_key]["paired_fraction_of_read_median"],
                     "fraction_method": "median over rounds of kernel / mean(read of all CPUs just before, just after)",
                     "best_over_best": summary[main_key]["best"] / read_all, "target": 0.75},
    }
    print(f"\nheadline: {main_key}: best {entry['headline']['kernel_gbps']:.1f} GB/s, paired median "
          f"{100 * entry['headline']['fraction_of_read']:.0f}% of the all-CPU read (best {read_all:.1f} GB/s; "
          f"best/best {100 * entry['headline']['best_over_best']:.0f}%; target 75%)")
    out = args.out / "cpu_expert_kernel.json"
    if not out.exists() and (RESULTS / out.name).exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text((RESULTS / out.name).read_text())   # merge into the entries already recorded
    data = json.loads(out.read_text()) if out.exists() else {}
    data.update({"benchmark": "cpu_expert_kernel", "shape": {"H": H, "I": I, "top_k": K},
                 "method": __doc__.strip().split("\n\n")[1]})
    data.setdefault("machines", {})[args.label] = entry
    write_results(out, data, plot)


def write_results(out: Path, data: dict, plot_fn) -> None:
    """The JSON, then its PNG next to it drawn by plot_fn (skipped, saying so, without matplotlib)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    try:
        plot_fn(data, out.with_suffix(".png"))
    except ImportError as exc:  # matplotlib absent (e.g. the GPU machine): the JSON is what counts
        print(f"no plot: {exc}")
    print(f"wrote {out}")


def plot(data: dict, path: Path) -> None:
    """One panel per machine: best GB/s of each side against the read bandwidth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    machines = data["machines"]
    fig, axes = plt.subplots(len(machines), 1, figsize=(11, 4.2 * len(machines)), squeeze=False)
    for ax, (label, m) in zip(axes[:, 0], machines.items()):
        res = m["results_gbps"]
        keys = [k for k in res if not k.startswith("read/")]
        vals = [res[k]["best"] for k in keys]
        colors = ["tab:blue" if k.startswith("kernel") else "tab:orange" for k in keys]
        ax.barh(range(len(keys)), vals, color=colors)
        ax.set_yticks(range(len(keys)), [k.replace("kernel/", "K ").replace("pytorch/", "PT ") for k in keys],
                      fontsize=6)
        read = m["headline"]["read_gbps_all_cpus"]
        ax.axvline(read, color="k", ls="--", label=f"STREAM-style read {read:.0f} GB/s")
        ax.axvline(0.75 * read, color="g", ls=":", label="75% of read")
        hw = m["hardware"]
        ax.set_title(f"{label}: {hw['cpu_model']}, {hw['cpus']} CPUs ({m['kernel_backend']})", fontsize=9)
        ax.set_xlabel("GB/s of expert weights (bf16, H 2048, I 768)")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
