"""What a long prompt's prefill costs the requests decoding beside it, by prefill step size.

A server decodes ``--decoders`` requests; then a ``--prompt``-token prompt arrives (a coding
agent's context). The scheduler prefills it ``--prefill-chunk`` tokens a step, each step beside
the decoders' tokens (one pass: ``Scheduler._step``), and every step streams the experts the
cache lacks over PCIe whatever its size (cache/prefetch.py). So a smaller step does not shorten
the decoders' pause per step, it multiplies the pauses. This measures it with the engine a user
runs (``EngineService``: the scheduler, CUDA graphs, the expert cache at a card's budget) for
each step size in ``--chunks``, one engine after another, each in a process of its own (two
engines' host banks would not fit the host's memory at once):

- the prompt's time to first token (submitted -> first token event);
- the decoders' inter-token gaps: their median before the prompt arrived (steady decode), and
  while it prefilled (from its submission to its first token): the longest, the median, and the
  tokens each decoder got in that window (its tokens/s against before).

``--pauses`` runs each step size at each ``--decode-pause-ms`` (0: the decoders ride in the
prefill's pass, one token a step; else they get steps of their own between its layers after
that wait, scheduler/beside.py), each its own engine and process.

Checkpoint: bench/engine_gpu_decode.py's (random bf16 weights in Qwen3-30B-A3B's shapes,
``--layers`` layers; ``--stretch /dev/shm``: a 2-layer packed checkpoint repeated). Random
weights route like uniform random routing, the worst case for the cache.

    python bench/decode_stall.py --layers 48 --stretch /dev/shm     # on the GPU machine
    python bench/decode_stall.py --model DIR --device cpu --prompt 2048 --chunks 512 --pauses 0,500
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from hardware import describe  # noqa: E402
from report import save  # noqa: E402


def listen(handle, times: list[float]) -> threading.Thread:
    """Record the arrival time of each of ``handle``'s token events, on a thread of its own."""
    def run():
        for _ in handle.events():
            times.append(time.perf_counter())
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def available_gb() -> float | None:
    """The host's MemAvailable (GB) as the next side starts: the last engine's bank released?"""
    try:
        line = next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return None
    return round(int(line.split()[1]) * 1024 / 1e9, 1)


def side(model: Path, chunk: int, pause: float, args, slots: int | None) -> dict:
    """One engine with ``chunk``-token prefill steps and ``pause`` ms decode pause: the decoders,
    then the prompt beside them."""
    from freetoken_engine.config import EngineConfig
    from freetoken_engine.scheduler.service import EngineService, SamplingParams
    cfg = EngineConfig(model=model, device=args.device, dtype="bfloat16" if args.device != "cpu" else None,
                       prefill_chunk=chunk,
                       expert_cache_experts=slots, max_context=args.prompt + 1024, max_batch=8,
                       decode_pause_ms=pause)
    svc = EngineService.start(cfg, wait=True)
    costs: list[float] = []                  # each decode step beside a pass: seconds
    if svc.scheduler.pause is not None:
        ran = svc.scheduler.pause.ran
        svc.scheduler.pause.ran = lambda s: (costs.append(s), ran(s))
    # what else can stop the decoders: a q* change (it drops the decode graphs) and the captures
    runner, events = svc.runner, []
    set_q, capture = runner._set_q, runner.graphs.capture if runner.graphs is not None else None
    runner._set_q = lambda q: (events.append((time.perf_counter(), f"q={q:.3f}")), set_q(q))
    if capture is not None:
        runner.graphs.capture = lambda c, k, **kw: (events.append((time.perf_counter(), f"capture {k}")),
                                                    capture(c, k, **kw))
    vocab = svc.runner.mcfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    try:
        times = [[] for _ in range(args.decoders)]
        decoders = []
        for i in range(args.decoders):
            ids = torch.randint(100, vocab - 1, (64,), generator=gen).tolist()
            decoders.append(svc.submit(ids, SamplingParams(max_new_tokens=900, temperature=0.0, ignore_eos=True)))
            listen(decoders[-1], times[i])
        while min(len(t) for t in times) < args.warm_tokens:
            time.sleep(0.01)
        ids = torch.randint(100, vocab - 1, (args.prompt,), generator=gen).tolist()
        first: list[float] = []
        sent = time.perf_counter()
        listen(svc.submit(ids, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)), first).join()
        arrived = first[0]
        time.sleep(args.after_s)
        for d in decoders:
            d.abort()
        stats = svc.stats()
    finally:
        svc.shutdown()
    before, during, got = [], [], []
    for ts in times:
        gaps = [(b, b - a) for a, b in zip(ts, ts[1:])]
        before += [g for t, g in gaps if t < sent]
        during += [g for t, g in gaps if sent < t <= arrived]
        got.append(sum(1 for t in ts if sent < t <= arrived))
    base = statistics.median(before)
    window = arrived - sent
    row = {"chunk": chunk, "decode_pause_ms": pause, "decode_steps_beside": stats["decode_steps_beside"],
           "events_s_from_prompt": [(round(t - sent, 3), what) for t, what in events if t > sent - 1.0][:20],
           "beside_step_ms": [round(1e3 * c, 2) for c in costs],
           "gaps_during_ms": sorted((round(1e3 * g, 1) for g in during), reverse=True)[:12],
           "prompt_tokens": args.prompt, "decoders": args.decoders, "ttft_s": window,
           "steps": -(-args.prompt // chunk), "itl_before_ms": 1e3 * base,
           "itl_during_max_ms": 1e3 * max(during, default=window), "itl_during_median_ms":
           1e3 * statistics.median(during) if during else 1e3 * window,
           "decoder_tokens_during": got, "decoder_speed_during_vs_before": (statistics.mean(got) / window) * base,
           "cache_experts": stats["expert_cache"]["capacity_experts"],
           "total_experts": stats["expert_cache"]["max_experts"], "graph_replays": stats["decode_graph_replays"]}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="a model folder instead of the generated checkpoint "
                    "(e.g. the default model on a CPU: every expert resident)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--stretch", type=Path, default=None, metavar="FAST_DIR")
    ap.add_argument("--card", default="32", help="expert-cache budget: card GiB, or all")
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--chunks", default="512,2048,8192")
    ap.add_argument("--pauses", default="0,100", help="--decode-pause-ms values, each with every chunk")
    ap.add_argument("--warm-tokens", type=int, default=24, help="tokens each decoder makes before the prompt")
    ap.add_argument("--after-s", type=float, default=0.5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=str(ROOT / "bench/results/decode_stall.json"))
    ap.add_argument("--side", nargs=4, metavar=("MODEL", "CHUNK", "PAUSE", "SLOTS"), help=argparse.SUPPRESS)
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return
    if args.side:                     # one engine, in this process: its row as the last line
        model, chunk, pause, slots = args.side
        print(json.dumps(side(Path(model), int(chunk), float(pause), args, int(slots) or None)), flush=True)
        return
    from engine_gpu_prefill import card_experts, raise_context
    from stretch import bench_checkpoint
    with tempfile.TemporaryDirectory(dir=args.stretch) as fast, tempfile.TemporaryDirectory() as work:
        slots = None
        if args.model is not None:
            model = args.model
        else:
            model, nbytes = bench_checkpoint(Path(work), args.layers, Path(fast) if args.stretch else None)
            raise_context(model, args.prompt + 1024)
            total = args.layers * 128
            slots = card_experts(args.card, "qwen3-30b", args.layers, total) if args.card != "all" else None
        rows = []
        for c in args.chunks.split(","):
            for pause in args.pauses.split(","):
                cmd = [sys.executable, __file__, "--side", str(model), c, pause, str(slots or 0),
                       "--device", args.device, "--decoders", str(args.decoders), "--prompt", str(args.prompt),
                       "--warm-tokens", str(args.warm_tokens), "--after-s", str(args.after_s)]
                avail = available_gb()
                out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]) | {"host_available_gb_before": avail})
    print(f"{'chunk':>6} {'pause ms':>8} {'steps':>5} {'beside':>6} {'TTFT s':>7} {'ITL before ms':>13} "
          f"{'max ITL during ms':>17} {'median during ms':>16} {'decoder speed during':>20}")
    for r in rows:
        print(f"{r['chunk']:6d} {r['decode_pause_ms']:8.0f} {r['steps']:5d} {r['decode_steps_beside']:6d} "
              f"{r['ttft_s']:7.2f} {r['itl_before_ms']:13.1f} "
              f"{r['itl_during_max_ms']:17.0f} {r['itl_during_median_ms']:16.0f} "
              f"{r['decoder_speed_during_vs_before']:19.2f}x")
    result = {"benchmark": "decode_stall", "hardware": describe(),
              "model": str(args.model) if args.model else f"generated, Qwen3-30B-A3B shapes, {args.layers} layers",
              "layers": None if args.model else args.layers, "card": None if args.model else args.card,
              "method": __doc__, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": " ".join(["python", "bench/decode_stall.py"] + sys.argv[1:]), "rows": rows}
    save(result, Path(args.out), plot)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = [f"{r['chunk']}/{r.get('decode_pause_ms', 0):g}" for r in rows]
    a.bar(range(len(x)), [r["ttft_s"] for r in rows])
    a.set_xticks(range(len(x)), x, fontsize=7)
    a.set_xlabel("prefill step tokens / decode pause ms")
    a.set_ylabel("s")
    a.set_title(f"{rows[0]['prompt_tokens']}-token prompt: time to first token", fontsize=9)
    b.bar([i - 0.2 for i in range(len(x))], [r["itl_before_ms"] for r in rows], 0.4, label="median before")
    b.bar([i + 0.2 for i in range(len(x))], [r["itl_during_max_ms"] for r in rows], 0.4, label="longest during")
    b.set_xticks(range(len(x)), x, fontsize=7)
    b.set_xlabel("prefill step tokens / decode pause ms")
    b.set_ylabel("ms")
    b.set_yscale("log")
    b.set_title(f"{rows[0]['decoders']} decoders' inter-token gap", fontsize=9)
    b.legend(fontsize=8)
    what = f"{result['layers']} layers, card {result['card']} GiB" if result.get("layers") else Path(result["model"]).name
    fig.suptitle(f"{what}, {result['hardware'].get('gpu') or result['hardware'].get('cpu', '?')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
