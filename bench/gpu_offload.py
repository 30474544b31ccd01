"""GPU offload benchmark: decode and prefill of the MoE layers against the bandwidth bounds.

Runs on one NVIDIA GPU (the project's H200). Random bf16 weights in the exact expert shapes of
Qwen3-30B-A3B (48 MoE layers, 128 experts, top-8, H 2048, I 768) and of Qwen3.6-35B-A3B's MoE
layers (40 layers, 256 experts, top-8, H 2048, I 512, one shared expert), generated in memory
into a pinned host bank. Only the MoE layers run: the non-expert compute (attention, norms,
router, LM head) is excluded; a token's hidden state still passes from layer to layer (one
kernel: the sum over k and an RMS normalisation) so that the CPU branch sits on the critical
path as it would.

Sides, every one in the same run, for expert-cache budgets that emulate 8/16/32 GB cards:
  (a) all     every expert resident on the GPU (the ceiling; budget independent)
  (b) static  whole layers resident as the budget allows, the other layers' experts computed on
              the CPU (the policy of llama.cpp's --n-cpu-moe), driven layer by layer from Python
              (a host sync and a kernel call per CPU layer)
  (b) static/graph  the same split run by (d)'s machinery: one CUDA graph a token, the C++ host
              loop, the control step with f = 0 over a pool holding the first layers (bit for bit
              the same hidden states, --check); the targets take the faster of the two as (b)
  (c) lru     global LRU cache, every miss filled over PCIe (q = m)
  (d) lru+q*  global LRU cache, q* of the misses filled (recurring misses first), the rest computed
              on the CPU meanwhile,
              with the engine's fill admission (cache/experts.py: a fill only evicts a slot idle for
              more than one token's layer calls, window = the MoE layer count) and its bypass slots
              (8 of the budget's slots outside the LRU: a refused fill still crosses PCIe into one,
              for its layer call only, so PCIe keeps its q* share)
  (d) runs a token as one CUDA graph; its CPU branch is a C++ host loop answering flags in
  pinned memory (freetoken_engine/kernels/cpu_branch.py). A/B rows at batch 1, locality:
  lru+q*/layer  (d) with the per-layer driver it replaced (two graph launches, an event and a
                Python call per layer)
  lru+q*/plain  (d) without fill admission (plain LRU victims) nor bypass slots
  lru+q*/nobypass  (d) with fill admission but no bypass slots (refused fills go to the CPU;
                the policy of run N)
  lru+q*/serial-hits  (d) with a layer's hits computed after its fills are copied, on the one
                stream (the engine before 2026-11-30), instead of on a side stream beside the copies
  lru+q*/ascending  (d) with its fills taken in ascending expert id, not recurring misses first
                (cache/experts.py: the engine before 2026-11-30)
  lru+q*/flat   (d) with q* from the 1-expert CPU rate for every call size (the rule before
                2026-12-06); (d) itself takes the CPU's rate by experts per call, measured in the
                run beside 1-fill launches (freetoken_engine/kernels/split.py)
  lru+q*/behind  (d) with fills behind the CPU: each call's idle PCIe time stages a slice of one
                CPU-computed expert on the device, which takes an idle LRU slot once every word is
                in (freetoken_engine/cache/behind.py); its copied bytes count as misses in the bound
  lru+q*/again  (d) once more, after the A/B rows: the same work, so (d) / (d) again is the
                row's run-to-run noise, the band an A/B ratio must leave to mean anything
  (d) and its A/B sides swap their order from one budget (and routing-batch block) to the next,
  so that a bias of a row's place in the run falls on each side alike (decode_plans)
  lru+q*@1      the handshake with every miss filled: lru+q*@1 vs lru is the cost of the
                captured CPU branch's flags
  lru+sync      (optional) the per-layer driver with every miss filled
  ...+s         (suffix, e.g. lru+q*+s, lru+q*@0.3+s) the streamed split: the first rows of the
                CPU experts also cross PCIe into scratch slots and are computed on the GPU, the
                CPU computes the rest (freetoken_engine/kernels/triton/stream.py); same fills
  ...+sf        the streamed split with floor(f m) fills instead of the rounded rule, so that no
                layer is PCIe-bound (fewer fills; the streamed rows balance the rest)
  ...+st        the split by stage (freetoken_engine/kernels/triton/stage.py): the same fills, and
                in 1-token calls the whole W2 of n CPU experts a layer crosses PCIe while the CPU
                computes their activations, the GPU their down projection (n balances PCIe
                against the CPU: > 0 only where PCIe would finish first)
  ...+stf       the split by stage with floor fills (the form of run 38)
Routing: uniform random (worst case) and a locality model (per-layer Zipf popularity, each of
the previous token's experts kept with probability `keep`; both fitted to the default model's
measured routing statistics, bench/results/default_model.json). Decode at batch 1 and 4;
prefill at 4k/8k/16k tokens with the double-buffered streamer vs a single buffer. The CPU side
of (b) and (d) is the engine's CPU expert path (the registry default: the compiled kernel).

Bandwidth-model bound of each row, per token, summed over layers, from the counts the row
measured: (a) active bytes / B_hbm; (b) GPU layers' active bytes / B_hbm + CPU layers' active
bytes / B_cpu; (c) filled bytes / B_pcie + active bytes / B_hbm; (d) missed bytes /
(B_pcie + B_cpu) + GPU-computed bytes / B_hbm: the misses split as if divisible, with B_pcie
and B_cpu measured while both run at once (the larger of each side's concurrent measurements).
For (d) two looser diagnostics are reported too: the best whole-expert split per layer call
(sum of min_q max(q / B_pcie, (m - q) / B_cpu)) and the split the policy chose.
Prefill bound: bytes over PCIe / B_pcie.

Usage: python bench/gpu_offload.py [--quick] [--layers N] [--models ...] [--out bench/results/gpu_offload.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload_workload import CUDA, MODELS, ROOT, Bank, make_routing, routing_params, routing_stats  # noqa: E402
from offload_bandwidth import bandwidths, tune_gather  # noqa: E402
from offload_measure import combine, control_step_us, tune_decode  # noqa: E402
from offload_check import check_cpu_branch  # noqa: E402
from offload_decode import decode_row  # noqa: E402
from freetoken_engine.cache.prefetch import LayerStreamer  # noqa: E402
from freetoken_engine.kernels.triton.moe import moe_slots_forward  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------------------------
def prefill_row(bank: Bank, seq: int, mode: str, bw: dict) -> dict:
    """One prefill pass of ``seq`` tokens over every MoE layer, uniform routing (prefill touches
    nearly every expert anyway). ``double``: LayerStreamer (copy stream, two layer buffers);
    ``single``: one buffer, each layer copied then computed on the same stream."""
    m = bank.model
    L, E, k, H = m["layers"], m["experts"], m["top_k"], m["hidden"]
    g = torch.Generator(device=CUDA).manual_seed(seq)
    ids = torch.stack([torch.rand(seq, E, device=CUDA, generator=g).topk(k, dim=-1).indices.flatten()
                       for _ in range(L)])                                                   # [L, seq*k]
    tok = torch.arange(seq, device=CUDA).repeat_interleave(k)
    shared_tok = torch.arange(seq, device=CUDA)
    x0 = torch.randn(seq, H, device=CUDA, generator=g).to(torch.bfloat16)
    if mode == "double":
        if getattr(bank, "_streamer", None) is None:
            bank._streamer = LayerStreamer(bank, CUDA)
        streamer = bank._streamer
    else:
        buf = (torch.empty(bank.w13.shape[1:], dtype=torch.bfloat16, device=CUDA),
               torch.empty(bank.w2.shape[1:], dtype=torch.bfloat16, device=CUDA))

    def weights(layer: int):
        if mode == "double":
            return streamer.layer(layer)
        buf[0].copy_(bank.w13[layer], non_blocking=True)
        buf[1].copy_(bank.w2[layer], non_blocking=True)
        return buf

    def run(n_layers: int, tokens: int) -> torch.Tensor:
        x = x0[:tokens]
        for layer in range(n_layers):
            w13, w2 = weights(layer)
            rows = moe_slots_forward(x, w13, w2, tok[:tokens * k], ids[layer, :tokens * k])
            shared = None
            if bank.shared is not None:
                s13, s2 = bank.shared
                shared = moe_slots_forward(x, s13, s2, shared_tok[:tokens], torch.full((tokens,), layer, device=CUDA))
            x = combine(rows, shared, torch.empty_like(x), k)
        return x

    run(2, 256)                                   # compiles the kernels
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    x = run(L, seq)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    if not torch.isfinite(x.float()).all():
        raise RuntimeError("prefill: non-finite hidden state")
    pcie_bytes = bank.bytes
    bound = pcie_bytes / (bw["pcie_h2d_gbps"] * 1e9)
    return {"tokens": seq, "mode": mode, "seconds": secs, "tok_s": seq / secs, "pcie_bytes": pcie_bytes,
            "bound_seconds": bound, "fraction_of_bound": bound / secs}


GiB = 1 << 30


def _cpu_features() -> dict:
    try:
        from freetoken_engine.kernels import cpu_experts
        return cpu_experts.cpu_features()
    except Exception as exc:  # the bench still runs on the reference; say why
        return {"backend": "reference", "error": repr(exc)}


def hardware() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mem = next((int(ln.split()[1]) * 1024 for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), 0)
    return {"gpu": torch.cuda.get_device_name(), "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
            "cpu": cpu, "cpu_cores": os.cpu_count(), "ram_bytes": mem, "python": platform.python_version(),
            "torch": torch.__version__, "triton": triton.__version__}


def cache_slots(card_gib: float, model: dict) -> int:
    """Expert-cache slots of a card: VRAM - non-expert weights - 1.5 GiB (KV cache, activations,
    CUDA context)."""
    free = card_gib * GiB - model["non_expert_bytes"] - 1.5 * GiB
    return max(int(free // model["expert_bytes"]), 1)


#: the A/B sides run beside (d) at each budget (lru+q*/again runs after them, lru+q*/layer and lru+sync last)
AB_SIDES = ("lru+q*@", "lru+q*+", "lru+q*/plain", "lru+q*/nobypass", "lru+q*/serial-hits", "lru+q*/ascending",
            "lru+q*/flat", "lru+q*/ahead", "lru+q*/predict@", "lru+q*/behind")


def decode_plans(policies: list[str], budgets: list[float], batch: int, routing: str,
                 flip: bool = False) -> list[tuple[str, float | None]]:
    """The decode rows of one (routing, batch) block, in run order: (policy, budget). (a) first;
    then each budget's (b), (c), and (d) with its A/B sides. The order of (d) and its A/B sides
    alternates from budget to budget, starting reversed when ``flip``, so that a bias of a row's
    place in the run (the host warming up, say) falls on each side alike; ``lru+q*/again`` runs
    after them, and the per-layer drivers (batch 1, locality only) last."""
    plans: list[tuple[str, float | None]] = [("all", None)] if "all" in policies else []
    pair = [p for p in policies if p == "lru+q*" or p.startswith(AB_SIDES)]
    pair = ["lru+q*", *(p for p in pair if p != "lru+q*")] if "lru+q*" in pair else pair
    tail = ["lru+q*/again"] if "lru+q*/again" in policies else []
    if batch == 1 and routing == "locality":
        tail += [p for p in policies if p.endswith("/layer")] + (["lru+sync"] if "lru+sync" in policies else [])
    for i, b in enumerate(budgets):
        sides = pair[::-1] if (i % 2 == 1) != flip else pair
        plans += [(p, b) for p in ("static", "static/graph", "lru") if p in policies]
        plans += [(p, b) for p in (*sides, *tail)]
    return plans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one model, one budget, few tokens (smoke test)")
    ap.add_argument("--models", default="qwen3-30b-a3b,qwen3.6-35b-a3b")
    ap.add_argument("--budgets", default="8,16,32")
    ap.add_argument("--policies", default="all,static,lru,lru+q*,lru+q*/layer,lru+q*@1",
                    help="lru+q*/layer and lru+sync run at batch 1, locality routing only; lru+q*@F (a fixed "
                         "fill fraction F instead of the measured q*) on every routing and batch")
    ap.add_argument("--prefill-tokens", default="4096,8192,16384")
    ap.add_argument("--layers", type=int, default=0, help="only the first N MoE layers (smoke tests)")
    ap.add_argument("--routings", default="locality,uniform")
    ap.add_argument("--decode-scale", type=int, default=1,
                    help="warm-up and timed decode tokens times this (a policy's cache further from the pre-fill)")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill rows")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode rows (a prefill run)")
    ap.add_argument("--check", action="store_true", help="run --quick's exactness check of the decode paths too")
    ap.add_argument("--no-tune", action="store_true", help="keep the default decode tiles")
    ap.add_argument("--tune-gather", action="store_true",
                    help="time fill-gather tiles first (on the H200 its 1-fill timings were erratic: 0.3-26 GB/s)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/gpu_offload.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    from freetoken_engine.kernels import cpu_expert_forward
    cpu_name, cpu_fn = cpu_expert_forward()
    result = {"benchmark": "gpu_offload", "hardware": hardware(), "cpu_expert_backend": cpu_name,
              "method": __doc__, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "cpu_expert_features": _cpu_features(), "routing_locality": {}, "bandwidth": {},
              "decode": [], "prefill": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(result, indent=1))

    names = args.models.split(",")[:1] if args.quick else args.models.split(",")
    budgets = [float(b) for b in args.budgets.split(",")][:1 if args.quick else None]
    for name in names:
        model = dict(MODELS[name], layers=args.layers or MODELS[name]["layers"])
        params = routing_params(ROOT, model)
        params["achieved"] = routing_stats(make_routing(model, 256, 1, "locality", params, seed=99), model["experts"])
        result["routing_locality"][name] = params
        print(f"[{name}] locality routing: {params}", flush=True)
        t0 = time.time()
        bank = Bank(model)
        print(f"[{name}] bank {bank.bytes / 1e9:.1f} GB pinned in {time.time() - t0:.0f} s", flush=True)
        if args.tune_gather:
            tiles = result.setdefault("gather_tiles", {})[name] = tune_gather(bank)
            print(f"[{name}] gather tiles (1 fill / 8 fills GB/s): " + "; ".join(
                f"{r['tiles']['chunks']}x{r['tiles']['block']}: {r['gbps_1']:.1f}/{r['gbps_8']:.1f}"
                for r in tiles["candidates"]), flush=True)
        bw = bandwidths(bank, cpu_fn)
        result["bandwidth"][name] = bw
        print(f"[{name}] " + ", ".join(f"{k} {v:.1f}" for k, v in bw.items() if isinstance(v, float)), flush=True)
        if "decode_tiles" not in result and not args.no_tune:
            result["decode_tiles"] = tune_decode(model)
            for r in result["decode_tiles"]["candidates"]:
                print(f"tiles {r['tiles']}: b1 {r['us_batch1']:.1f} us ({r['gbps_batch1']:.0f} GB/s), "
                      f"b4 {r['us_batch4']:.1f} us ({r['gbps_batch4']:.0f} GB/s)", flush=True)
        result.setdefault("control_step_us", {})[name] = {
            str(b): control_step_us(bank, cache_slots(b, model)) for b in budgets}
        print(f"[{name}] control step us per layer call: {result['control_step_us'][name]}", flush=True)
        save()
        for seq in [] if args.no_prefill else ([8192] if args.quick else [int(n) for n in args.prefill_tokens.split(",")]):
            for mode in ("double", "single"):
                try:
                    row = prefill_row(bank, seq, mode, bw)
                except Exception as exc:  # keep the other rows: record the failure in the results
                    row = {"tokens": seq, "mode": mode, "error": repr(exc), "tok_s": 0.0, "seconds": 0.0,
                           "bound_seconds": 0.0, "fraction_of_bound": 0.0}
                row["model"] = name
                result["prefill"].append(row)
                print(f"[{name}] prefill {seq:6d} {mode:7s} {row['tok_s']:8.0f} tok/s  {row['seconds']:.3f} s  "
                      f"bound {row['bound_seconds']:.3f} s ({row['fraction_of_bound']:.2f})", flush=True)
                save()
        if args.quick or args.check:
            result.setdefault("checks", {})[name] = check_cpu_branch(bank, cache_slots(budgets[0], model), bw, cpu_fn)
            print(f"[{name}] CPU-branch check: {result['checks'][name]}", flush=True)
        tokens = {1: (6, 8) if args.quick else (12, 16), 4: (4, 4) if args.quick else (6, 8)}
        tokens = {b: (w * args.decode_scale, n * args.decode_scale) for b, (w, n) in tokens.items()}
        block = 0                   # (routing, batch) blocks so far: the A/B sides' order alternates
        for routing in [] if args.no_decode else args.routings.split(","):
            for batch in (1, 4):
                warm, meas = tokens[batch]
                # the first n_fill tokens only fill the LRU caches (offload_decode._fill_cache)
                n_fill = 16 if args.quick else 48
                ids = make_routing(model, n_fill + warm + meas, batch, routing, params, seed=batch)
                fill_ids, ids = ids[:n_fill], ids[n_fill:]
                plans = decode_plans(args.policies.split(","), budgets, batch, routing, flip=block % 2 == 1)
                block += 1
                for policy, budget in plans:
                    slots = bank.total_experts if budget is None else cache_slots(budget, model)
                    try:
                        row = decode_row(bank, policy, slots, ids, warm, bw, cpu_fn, fill_ids=fill_ids)
                    except Exception as exc:  # keep the other rows: record the failure in the results
                        row = {"policy": policy, "cache_slots": slots, "error": repr(exc), "tok_s": 0.0,
                               "miss_rate": 0.0, "bound_tok_s": 0.0, "fraction_of_bound": 0.0}
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                    row.update(model=name, routing=routing, batch=batch, budget_gib=budget)
                    result["decode"].append(row)
                    extra = ""
                    if "fraction_of_integer_split_bound" in row:
                        prof = row["host_profile_ms_per_step"]
                        extra = (f" int {row['fraction_of_integer_split_bound']:.2f} act "
                                 f"{row['fraction_of_actual_split_bound']:.2f} | ms wait {prof['wait']:.2f} cpu "
                                 f"{prof['cpu']:.2f} launch {prof['launch']:.2f} | step ms median "
                                 f"{row['step_ms_median']:.2f} max {row['step_ms_max']:.2f}")
                    print(f"[{name}] {routing:8s} b{batch} {policy:8s} {str(budget):5s} slots {slots:6d} "
                          f"{row['tok_s']:8.2f} tok/s miss {row['miss_rate']:.3f} bound {row['bound_tok_s']:8.2f} "
                          f"({row['fraction_of_bound']:.2f}){extra}", flush=True)
                    save()
        bank.free()
        del bank
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save()
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    """Per model: decode tok/s of every policy the run has (bars) against its bound ('-'), grouped
    by routing, batch and budget; then prefill against the PCIe bound when the run has it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(result["bandwidth"])
    decoded = [name for name in models if any(r["model"] == name for r in result["decode"])]
    panels = len(decoded) + bool(result["prefill"])
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4.8), squeeze=False)
    axes = list(axes[0])
    for ax, name in zip(axes, decoded):
        rows = [r for r in result["decode"] if r["model"] == name and r["policy"] != "all"]
        groups = sorted({(r["routing"], r["batch"], r["budget_gib"]) for r in rows})
        policies = list(dict.fromkeys(r["policy"] for r in rows))
        width = 0.8 / max(len(policies), 1)
        for i, pol in enumerate(policies):
            sel = [next((r for r in rows if r["policy"] == pol and (r["routing"], r["batch"], r["budget_gib"]) == g),
                        None) for g in groups]
            xs = [j + width * (i - (len(policies) - 1) / 2) for j in range(len(groups))]
            ax.bar(xs, [r["tok_s"] if r else 0 for r in sel], width, label=pol)
            ax.scatter(xs, [r["bound_tok_s"] if r else 0 for r in sel], marker="_", s=200, color="k")
        ax.set_xticks(range(len(groups)), [f"{rt}\nb{b}, {g:g} GB" for rt, b, g in groups], fontsize=8)
        if any(r["tok_s"] > 0 for r in rows):
            ax.set_yscale("log")
        ax.set_title(f"{name} decode (bars measured, '-' bandwidth bound)")
        ax.set_ylabel("tok/s (MoE layers only)")
        ax.legend(fontsize=8)
    if result["prefill"]:
        ax = axes[-1]
        for name in models:
            for mode, ls in (("double", "-"), ("single", ":")):
                rows = [r for r in result["prefill"] if r["model"] == name and r["mode"] == mode]
                if rows:
                    ax.plot([r["tokens"] for r in rows], [r["tok_s"] for r in rows], ls, marker="o",
                            label=f"{name} {mode}")
            rows = [r for r in result["prefill"] if r["model"] == name and r["mode"] == "double"]
            ax.plot([r["tokens"] for r in rows], [r["tokens"] / r["bound_seconds"] for r in rows], "k--", lw=0.8)
        ax.set_xscale("log", base=2)
        other = result.get("prefill_hardware", result["hardware"])     # a prefill run merged from another machine
        ax.set_title("prefill (dashed: PCIe bound)" + (f", {other['gpu']}" if other != result["hardware"] else ""))
        ax.set_xlabel("tokens")
        ax.set_ylabel("tok/s")
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['hardware']['gpu']}, {result['hardware']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
