"""The whole engine's decode on a GPU: CUDA graphs vs eager, sync-free CPU branch vs per-layer sync.

The MoE-only benchmark (``gpu_offload.py``) times the expert layers alone; this one times the
engine a user runs (``freetoken serve`` / ``LLM``): attention over the paged KV pool, routers,
the expert cache's device control, fills, the q* split with its CPU experts, the LM head, and
the sampler's read of the logits. Sides, each in its own process on the same checkpoint and in
the same run (the engine reads its switches at start):

  eager/sync    no graphs, CPU pairs by a per-layer device-to-host sync (FREETOKEN_HOST_BRANCH=off)
  eager/branch  no graphs, the sync-free CPU branch (host loop answering device flags)
  graphs        one CUDA graph per decode step, the CPU branch inside it, q* as calibrated
  graphs+tuning the same with the split tuner (executor/split_tuner.py, --split-tuning): it searches
                over 900 decode steps of other prompts first; the q it found is then held for
                the same warm-up and timed steps as the other sides (same prompts, same contexts)
  graphs/serial-hits  graphs with a layer's hits computed after its fill copies, in one call with
                the filled experts (``DeviceControl.overlap_hits = False``: the engine before
                2026-11-30; now the hits, and a shared expert, run on a side stream beside the copies)
  graphs/hits-ab  both of the above in one process, alternating per budget and batch (2 rounds,
                the graphs captured again at each switch), at the q* this process calibrated: rows
                "hits beside fills" and "hits after fills" (a same-process A/B; separate processes
                may calibrate different q*)
  graphs/gemv-ab  the same kind of A/B for the dense projections (attention, shared expert, LM
                head): rows "triton gemv" (kernels/triton/gemv.py) and "cublas gemv" (torch's F.linear:
                FREETOKEN_GPU_DECODE_KERNELS without gemv, the engine before 2026-11-30's twenty-first session),
                after one untimed timing (the cache filling), rounds in the orders A, B then B, A, with
                q held at its calibration (no CPU-rate follower)
  graphs/control-ab  the same for the expert cache's control step: rows "control skips" (a call
                without a miss skips the pool-wide scan of every slot's clock) and "control scans"
                (the engine before 2026-11-30's twenty-first session)
  graphs/threshold-ab  the same for decode batches of 16+: rows "cache path" (the expert cache and
                its graphs up to max_batch, the default) and "whole layers from 16" (the prefill's
                whole-layer path from 16 tokens, eager: the engine before the twenty-second session)
  graphs/moe-lanes-ab  the same for a one-token call's routed experts: rows "moe lanes" (the lanes
                kernels of kernels/triton/moe.py) and "moe tiled" (the tiled kernels, the engine before
                2026-12-04's forty-eighth stop)
  graphs/copy-first  graphs with a layer's fill copies queued before the host is signalled (the
                engine's order before 2026-11-29: PCIe, then the CPU experts, in series)
  graphs/flat-speed  graphs with q* from the 1-expert CPU rate at every call size (the engine
                before 2026-12-06: no call-size curve, kernels/split.py)
  graphs+stream graphs with the streamed split (FREETOKEN_STREAM_SPLIT=on: the first rows of the
                CPU experts also cross PCIe and run on the GPU; same fills)
  graphs+stream-floor  the same with floor(q* m) fills (FREETOKEN_STREAM_SPLIT=floor)
  graphs/no-deltanet  graphs with a hybrid model's Gated DeltaNet decode step as torch's ops (the
                engine before kernels/triton/deltanet.py)
  graphs/torch-ops  graphs with attention, RMSNorm and the router's selection as torch's ops
                (FREETOKEN_GPU_DECODE_KERNELS=off: the engine before kernels/triton/attention.py,
                norm.py and route.py)
  graphs/no-combine  graphs without the residual stream's fusions (the MoE combine, the CPU
                branch's row selection and the residual adds as torch's ops:
                FREETOKEN_GPU_DECODE_KERNELS=attention,norm,route, the engine before
                kernels/triton/combine.py)
  graphs/lru    graphs with plain LRU victims (FREETOKEN_FILL_ADMISSION=off: the engine before the
                expert cache's fill admission, cache/experts.py)
  graphs+prefetch  graphs with cross-layer expert prefetch (FREETOKEN_EXPERT_PREFETCH=on, decode
                calls of one sequence): each MoE layer guesses the next layer's experts with that
                layer's router on its own input, and the guessed misses are copied while it
                computes (DeviceControl.prefetch); "graphs+prefetch@P" (1, 0.9, 0.7): in every decode
                call (=all), with a replayed routing, guesses of the next layer's traced experts
                right with probability P (bench/routing_replay.py)
  graphs+behind graphs with fills behind the CPU (FREETOKEN_FILL_BEHIND=on, cache/behind.py: each
                decode call's idle PCIe time copies a slice of one CPU-computed expert into the cache)
  graphs/all-cpus  graphs with the CPU expert kernel on every CPU (FREETOKEN_CPU_EXPERT_THREADS =
                the affinity set) instead of the GPU host's default of all but one

Checkpoint: random bf16 weights (normal, std 0.02) in Qwen3-30B-A3B's shapes (H 2048, 32/4 heads
of 128, 128 experts of I 768, top-8, vocab 32000; ``--shape qwen3.6``: 256 experts of I 512 and
a sigmoid-gated shared expert of 512, Qwen2-MoE attention of 16/2 heads) but ``--layers`` layers, written once with
safetensors; or, with ``--stretch DIR`` (deeper models than the disk holds: 48 layers are about
60 GB), a 2-layer packed checkpoint whose layers repeat up to ``--layers``, in a RAM-backed DIR
such as /dev/shm (``bench/stretch.py``). Expert-cache budgets are fractions of the experts; q* comes from the engine's own
calibration. Per budget and batch: 32-token prompts, 24 warm-up steps (cache fills, graph
captures), then ``--steps`` timed steps; tok/s = batch * steps / seconds. Routing (``--routing``): the MoE
bench's locality (the default) or uniform routing replayed through the routers in every decode
step (``bench/routing_replay.py``; prefill keeps the real routers), or the checkpoint's random
routers ("model": they route nearly the same experts every step, so the cache fills little; the
results written before the option existed, whose JSON has no "routing").

    python bench/engine_gpu_decode.py            # on the GPU machine; writes bench/results/engine_gpu_decode.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from engine_ab import AB_SIDES, timed  # noqa: E402
from hardware import describe  # noqa: E402

# side -> (FREETOKEN_HOST_BRANCH, CUDA graphs, FREETOKEN_STREAM_SPLIT, FREETOKEN_GPU_DECODE_KERNELS,
#          FREETOKEN_FILL_ADMISSION)
SIDES = {"eager/sync": ("off", False, "off", "on", "on"), "eager/branch": ("on", False, "off", "on", "on"),
         "graphs": ("on", True, "off", "on", "on"), "graphs+tuning": ("on", True, "off", "on", "on"),
         "graphs/copy-first": ("on", True, "off", "on", "on"), "graphs/serial-hits": ("on", True, "off", "on", "on"),
         "graphs/flat-speed": ("on", True, "off", "on", "on"),
         "graphs/hits-ab": ("on", True, "off", "on", "on"), "graphs+stream": ("on", True, "on", "on", "on"),
         "graphs+stream-floor": ("on", True, "floor", "on", "on"),
         "graphs/torch-ops": ("on", True, "off", "off", "on"),
         "graphs/no-combine": ("on", True, "off", "attention,norm,route", "on"),
         "graphs/no-deltanet": ("on", True, "off", "attention,norm,route,combine,gemv", "on"),
         "graphs/lru": ("on", True, "off", "on", "off"), "graphs/all-cpus": ("on", True, "off", "on", "on"),
         "graphs/gemv-ab": ("on", True, "off", "on", "on"), "graphs/control-ab": ("on", True, "off", "on", "on"),
         "graphs/threshold-ab": ("on", True, "off", "on", "on"),
         "graphs/moe-lanes-ab": ("on", True, "off", "on", "on"),
         "graphs+prefetch": ("on", True, "off", "on", "on"), "graphs+prefetch@1": ("on", True, "off", "on", "on"),
         "graphs+prefetch@0.9": ("on", True, "off", "on", "on"),
         "graphs+prefetch@0.7": ("on", True, "off", "on", "on"), "graphs+behind": ("on", True, "off", "on", "on")}
#: sides with FREETOKEN_EXPERT_PREFETCH=on; "@P": with a replayed routing, guesses of the next
#: layer's traced experts right with probability P (routing_replay.install_guesses); without "@",
#: the next layer's own router on this layer's input (the engine's predictor: with a replayed
#: routing its guesses are nearly all wrong, so that side measures what wrong guesses cost)
PREFETCH = {"graphs+prefetch", "graphs+prefetch@1", "graphs+prefetch@0.9", "graphs+prefetch@0.7"}
#: sides that also set the CPU expert kernel's threads: every CPU of the affinity set
ALL_CPUS = {"graphs/all-cpus"}
TUNING_SEARCH = 900


def worker(model: Path, side: str, fractions: list[float], batches: list[int], steps: int,
           device: str, splits: list[float], routing: str = "model") -> list[dict]:
    """Rows of one side; with ``splits`` (the graphs side), each budget and batch also runs at
    those fill fractions in place of the calibrated q* (side "graphs q=F"): where the calibrated
    split sits among the ones around it, in the same process. ``routing``: "model" (the
    checkpoint's routers) or a generated routing replayed through them (bench/routing_replay.py)."""
    from freetoken_engine import LLM
    from freetoken_engine.llm import Lockstep
    tuning = side == "graphs+tuning"
    if side == "graphs/copy-first":
        from freetoken_engine.cache.host_branch import HostBranch
        HostBranch.copy_after_signal = False
    if side == "graphs/serial-hits":
        from freetoken_engine.cache.device_control import DeviceControl
        DeviceControl.overlap_hits = False
    # no graphs ahead of time: the resize below would drop them (warm-up steps capture instead)
    # (the gemv and control A/Bs: q held where the calibration put it; the CPU-rate follower would move it)
    llm = LLM(model, device=device, dtype="bfloat16", cuda_graphs=SIDES[side][1], split_tuning=tuning, graph_warmup=0,
              cpu_rate_probe=side not in ("graphs/gemv-ab", "graphs/control-ab", "graphs/threshold-ab",
                                          "graphs/moe-lanes-ab"))
    runner = llm.runner
    if side == "graphs/flat-speed":      # q* from the 1-expert CPU rate at every call size (set below)
        runner.cache.cpu_speed = None
    if routing != "model":
        from routing_replay import install
        install(runner.model, routing, batches)
        if "@" in side:
            from routing_replay import install_guesses
            install_guesses(runner.model, float(side.split("@")[1]))
    elif "@" in side:
        raise SystemExit(f"{side} needs a replayed routing (--routing locality or uniform)")
    total = runner.bank.total_experts
    calibrated = runner.expert_stats()["fill_fraction"]
    rows = []
    if side in AB_SIDES:        # at the calibrated q, then at each of --splits (rows tagged "q=F")
        for q in [None] + splits:
            for row in AB_SIDES[side](llm, Lockstep, fractions, batches, steps, calibrated if q is None else q):
                rows.append(row if q is None else dict(row, side=f"{row['side']} q={q:g}"))
        return rows
    for frac in fractions:
        runner.resize_expert_cache(max(1, round(frac * total)))
        for b in batches:
            for q in [None] + (splits if frac < 1.0 else []):
                runner.set_fill_fraction(calibrated if q is None else q)     # (the tuner starts over)
                found = _search(llm, Lockstep, b) if tuning and frac < 1.0 and runner.tuner else None
                tuner = runner.tuner
                if found is not None:
                    runner.tuner = None                   # hold the q it found while timing
                    runner.set_fill_fraction(found["fill_fraction"])
                rows.append(timed(llm, Lockstep, side if q is None else f"{side} q={q:g}", frac, b, steps))
                rows[-1]["split_tuner"] = found
                runner.tuner = tuner
                print(json.dumps(rows[-1]), flush=True)
    runner.set_fill_fraction(calibrated)
    return rows


def _search(llm, Lockstep, b: int) -> dict:
    """The split tuner's search: TUNING_SEARCH decode steps of b other prompts; -> its stats."""
    batch = Lockstep(llm, [[(53 * i + 7 * t) % 31000 + 100 for t in range(32)] for i in range(b)])
    for _ in range(TUNING_SEARCH):
        batch.step()
    batch.close()
    return llm.runner.tuner.stats()


def run_sides(work: Path, fast: Path | None, args) -> tuple[int, list[dict], list[str]]:
    """Write the checkpoint into ``work`` (with ``--stretch``: a 2-layer packed one repeated to
    ``--layers`` layers in ``fast``, bench/stretch.py), then run each side in its own process on it."""
    from stretch import bench_checkpoint
    t0 = time.perf_counter()
    model, nbytes = bench_checkpoint(work, args.layers, fast, args.shape)
    print(f"checkpoint: {args.layers} layers, {nbytes / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    rows, failed = [], []
    for side in args.sides.split(","):          # in the order asked (A/B rounds swap it)
        branch, _, stream, kernels, admission = SIDES[side]
        env = dict(os.environ, FREETOKEN_HOST_BRANCH=branch, FREETOKEN_STREAM_SPLIT=stream,
                   FREETOKEN_GPU_DECODE_KERNELS=kernels, FREETOKEN_FILL_ADMISSION=admission)
        if side in ALL_CPUS:
            env["FREETOKEN_CPU_EXPERT_THREADS"] = str(len(os.sched_getaffinity(0)))
        # "@P" sides prefetch in every decode call (as measured in run 4 of 2026-12-03, when "on"
        # meant that); the plain side has the engine's "on": calls of one sequence
        env["FREETOKEN_EXPERT_PREFETCH"] = ("all" if "@" in side else "on") if side in PREFETCH else "off"
        env["FREETOKEN_FILL_BEHIND"] = "on" if side == "graphs+behind" else "off"
        cmd = [sys.executable, __file__, "--worker", side, "--model", str(model), "--fractions",
               args.fractions, "--batches", args.batches, "--steps", str(args.steps), "--device", args.device,
               "--splits", args.splits if side == "graphs" or side in AB_SIDES else "", "--routing", args.routing]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS ")), None)
        if proc.returncode or line is None:
            log = Path(args.out).with_suffix(f".{side.replace('/', '-')}.log")
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
            print(f"{side} failed (exit {proc.returncode}; full log {log}):\n{proc.stderr[:3000]}", flush=True)
            failed.append(side)
            continue
        rows += json.loads(line[5:])
    return nbytes, rows, failed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--fractions", default="0.25,0.5,1.0")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)")
    ap.add_argument("--stretch", type=Path, default=None, metavar="FAST_DIR",
                    help="a 2-layer packed checkpoint repeated to --layers layers, in a temp folder under "
                         "FAST_DIR (e.g. /dev/shm: no disk reads; bench/stretch.py): deep models on a small disk")
    ap.add_argument("--shape", default="qwen3-30b", choices=("qwen3-30b", "qwen3.6", "qwen3.6-hybrid", "ernie4.5-21b",
                                                             "glm4.5-air", "gpt-oss-20b"),
                    help="the checkpoint's shapes (bench/fast_load.py SHAPES): Qwen3-30B-A3B, "
                         "Qwen3.6-35B-A3B's MoE layers with their shared expert, ERNIE-4.5-21B-A3B's, "
                         "GLM-4.5-Air's or gpt-oss-20b's MoE layers")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    ap.add_argument("--routing", default="locality", choices=("model", "locality", "uniform"),
                    help="locality / uniform: the MoE bench's generated routing replayed through the routers "
                         "(bench/routing_replay.py); model: the random checkpoint's own routers, which route nearly "
                         "the same experts every step (every result before 2026-11-30's twentieth session)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench/results/engine_gpu_decode.json"))
    ap.add_argument("--sides", default="eager/sync,eager/branch,graphs,graphs+tuning,graphs/copy-first,graphs+stream,"
                    "graphs+stream-floor", help="comma-separated sides (see the docstring)")
    ap.add_argument("--splits", default="", help="fill fractions to run beside the calibrated q* (graphs and A/B sides), "
                    "e.g. 0.3,0.45,0.6")
    args = ap.parse_args()
    unknown = [side for side in args.sides.split(",") if side not in SIDES]
    if unknown:
        ap.error(f"unknown side(s) {', '.join(unknown)}; known: {', '.join(SIDES)}")
    fractions = [float(x) for x in args.fractions.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    if args.worker:
        splits = [float(x) for x in args.splits.split(",") if x]
        rows = worker(args.model, args.worker, fractions, batches, args.steps, args.device, splits, args.routing)
        print("ROWS " + json.dumps([dict(r, routing=args.routing) for r in rows]), flush=True)
        return
    work = Path(tempfile.mkdtemp(dir=args.dir))
    fast = Path(tempfile.mkdtemp(dir=args.stretch)) if args.stretch else None
    try:
        nbytes, rows, failed = run_sides(work, fast, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)      # the checkpoint is several GB
        if fast is not None:
            shutil.rmtree(fast, ignore_errors=True)
    table(rows)
    result = {"benchmark": "engine_gpu_decode", "hardware": describe(),
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", "bench/engine_gpu_decode.py"] + sys.argv[1:]),
              "method": __doc__, "layers": args.layers, "shape": args.shape, "routing": args.routing,
              "checkpoint_bytes": nbytes,
              "stretched": bool(args.stretch), "rows": rows,
              "failed_sides": failed, "ratios": ratios(rows)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out}")
    if failed:
        sys.exit(f"failed sides: {', '.join(failed)}")


def ratios(rows: list[dict]) -> dict:
    """Every other side against graphs, and eager-branch / eager-sync, per budget and batch (same run)."""
    by = {(r["side"], r["cache_fraction"], r["batch"]): r["tok_s"] for r in rows}
    out = {}
    for (side, frac, b), v in by.items():
        if side != "graphs":
            continue
        key = f"cache {frac:g} b{b}"
        out[key] = {f"{other}_vs_graphs": by[(other, frac, b)] / v for other in SIDES
                    if other not in ("graphs", "eager/sync", "eager/branch") and (other, frac, b) in by}
        if ("eager/branch", frac, b) in by and ("eager/sync", frac, b) in by:
            out[key] |= {"graphs_vs_eager_branch": v / by[("eager/branch", frac, b)],
                         "graphs_vs_eager_sync": v / by[("eager/sync", frac, b)],
                         "eager_branch_vs_eager_sync": by[("eager/branch", frac, b)] / by[("eager/sync", frac, b)]}
    # the same-process A/B sides: each round's first arm / second, in the order they ran
    for key, (a, b_) in {"hits_beside_vs_after_per_round": ("hits beside fills", "hits after fills"),
                         "triton_vs_cublas_gemv_per_round": ("triton gemv", "cublas gemv"),
                         "control_skips_vs_scans_per_round": ("control skips", "control scans")}.items():
        for frac, b in sorted({(r["cache_fraction"], r["batch"]) for r in rows}):
            first, second = ([r["tok_s"] for r in rows if r["side"] == name and (r["cache_fraction"], r["batch"]) == (frac, b)]
                             for name in (a, b_))
            if first and second:
                out.setdefault(f"cache {frac:g} b{b}", {})[key] = [x / y for x, y in zip(first, second)]
    return out


def table(rows: list[dict]) -> None:
    print(f"{'side':18} {'cache':>5} {'batch':>5} {'tok/s':>8} {'ms/step':>8} {'miss':>6} {'cpu/step':>8} {'q':>5}")
    for r in rows:
        print(f"{r['side']:18} {r['cache_fraction']:5.2f} {r['batch']:5d} {r['tok_s']:8.1f} {r['ms_per_step']:8.2f} "
              f"{r['miss_rate']:6.3f} {r['cpu_experts_per_step']:8.1f} {r['fill_fraction']:5.2f}")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    keys = sorted({(r["cache_fraction"], r["batch"]) for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    sides = list(dict.fromkeys(r["side"] for r in rows))
    width = 0.8 / len(sides)
    for i, side in enumerate(sides):       # the median over a side's rounds
        vals = [statistics.median([r["tok_s"] for r in rows if r["side"] == side
                                   and (r["cache_fraction"], r["batch"]) == k] or [0]) for k in keys]
        ax.bar([j + width * (i - (len(sides) - 1) / 2) for j in range(len(keys))], vals, width, label=side)
    ax.set_xticks(range(len(keys)), [f"cache {f:g}\nbatch {b}" for f, b in keys])
    ax.set_ylabel("decode tok/s (whole engine)")
    ax.set_title(f"engine decode, {result['layers']}-layer MoE in {result.get('shape', 'qwen3-30b')}'s shapes, "
                 f"routing: {result.get('routing', 'model')}\n"
                 f"{result['hardware'].get('gpu', '?')}, {result['hardware']['cpu']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
