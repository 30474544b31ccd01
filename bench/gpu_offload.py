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
              the CPU (the policy of llama.cpp's --n-cpu-moe)
  (c) lru     global LRU cache, every miss filled over PCIe (q = m)
  (d) lru+q*  global LRU cache, q* of the misses filled, the rest computed on the CPU meanwhile
  optional, --policies lru+sync: (d)'s per-layer host round trip with every miss filled, so
              that lru+sync minus lru is the measured cost of not capturing the CPU branch
Routing: uniform random (worst case) and a locality model (per-layer Zipf popularity, each of
the previous token's experts kept with probability `overlap`). Decode at batch 1 and 4;
prefill at 4k/8k/16k tokens with the double-buffered streamer vs a single buffer.

Bandwidth-model bound of each row, per token, summed over layers, from the counts the row
measured: (a) active bytes / B_hbm; (b) GPU layers' active bytes / B_hbm + CPU layers' active
bytes / B_cpu; (c) filled bytes / B_pcie + active bytes / B_hbm; (d) per layer
max(filled / B_pcie, cpu bytes / B_cpu) + GPU-computed bytes / B_hbm, with B_pcie and B_cpu
measured while both run at once. Prefill bound: bytes over PCIe / B_pcie.

Usage: python bench/gpu_offload.py [--quick] [--out bench/results/gpu_offload.json]
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
from offload_workload import CUDA, MODELS, ROOT, Bank, make_routing, routing_params  # noqa: E402
from offload_measure import _capture, _Token, bandwidths, combine, control_step_us, tune_decode  # noqa: E402
from freetoken_engine.cache.device_control import DeviceControl  # noqa: E402
from freetoken_engine.cache.prefetch import LayerStreamer  # noqa: E402
from freetoken_engine.kernels.triton.gather import gather_fill_rows  # noqa: E402
from freetoken_engine.kernels.triton.moe import moe_slots_forward  # noqa: E402


def decode_row(bank: Bank, policy: str, slots: int, ids: torch.Tensor, warm: int, bw: dict, cpu_fn) -> dict:
    """Decode ``ids [n_tok, L, T, k]`` under ``policy``; time the tokens after ``warm``."""
    m = bank.model
    L, E, k, se = m["layers"], m["experts"], m["top_k"], m["expert_bytes"]
    n_tok, batch = ids.shape[0], ids.shape[2]
    st = _Token(bank, batch)
    distinct = torch.tensor([[len(set(ids[t, l].flatten().tolist())) for l in range(L)] for t in range(n_tok)])
    ctl = None
    if policy in ("all", "static"):
        pool13, pool2 = bank.all_resident()
        n_gpu = L if policy == "all" else min(slots // E, L)
        slots = n_gpu * E

        def gpu_layers():
            for l in range(n_gpu):
                rows = moe_slots_forward(st.x[l], pool13, pool2, st.tok, st.ids[l].view(-1) + l * E, out=st.rows[l])
                st.combine(l, rows)

        ev = torch.cuda.Event()
        h_x = torch.zeros(batch, m["hidden"], dtype=torch.bfloat16).pin_memory()
        h_rows = torch.zeros(st.P, m["hidden"], dtype=torch.bfloat16).pin_memory()

        def token(graph):
            if graph is not None:
                graph.replay()
            else:
                gpu_layers()
            for l in range(n_gpu, L):                   # CPU layers: all their experts on the CPU
                h_x.copy_(st.x[l], non_blocking=True)
                ev.record()
                ev.synchronize()
                h_rows.copy_(cpu_fn(h_x, bank.w13[l], bank.w2[l], st.h_tok, st.h_ids_in[l].view(-1)))
                st.rows[l].copy_(h_rows, non_blocking=True)
                st.combine(l, st.rows[l])
    else:
        w13s = torch.empty((slots, *bank.w13.shape[2:]), dtype=torch.bfloat16, device=CUDA)
        w2s = torch.empty((slots, *bank.w2.shape[2:]), dtype=torch.bfloat16, device=CUDA)
        minus = lambda n: torch.full((n,), -1, dtype=torch.int64, device=CUDA)  # noqa: E731
        ctl = DeviceControl(bank.w13, bank.w2, w13s, w2s, minus(L * E).view(L, E), minus(slots), minus(slots), 0,
                            bw["fill_fraction"] if policy == "lru+q*" else 1.0)
        if policy == "lru":
            def gpu_layers():
                for l in range(L):
                    out = ctl.step(l, st.ids[l])
                    st.combine(l, moe_slots_forward(st.x[l], w13s, w2s, st.tok, out.pair_slot, out=st.rows[l]))

            def token(graph):
                graph.replay() if graph is not None else gpu_layers()
        else:
            h_ps = torch.zeros(L, st.P, dtype=torch.int64).pin_memory()
            h_x = torch.zeros(batch, m["hidden"], dtype=torch.bfloat16).pin_memory()
            h_rows = torch.zeros(st.P, m["hidden"], dtype=torch.bfloat16).pin_memory()
            d_rows = torch.zeros(st.P, m["hidden"], dtype=torch.bfloat16, device=CUDA)
            gpu_rows = torch.zeros(st.P, m["hidden"], dtype=torch.bfloat16, device=CUDA)
            ev = torch.cuda.Event()

            def seg_a(l):              # control step; what the CPU branch needs goes to the host
                out = ctl.step(l, st.ids[l], copy=False)
                h_ps[l].copy_(out.pair_slot, non_blocking=True)
                h_x.copy_(st.x[l], non_blocking=True)

            def seg_b(l):              # fills over PCIe, then the GPU's experts
                out = ctl.outputs(st.P)
                gather_fill_rows(bank.w13, bank.w2, w13s, w2s, l, out.fill_exp, out.fill_slot)
                moe_slots_forward(st.x[l], w13s, w2s, st.tok, out.pair_slot, out=gpu_rows)

            def seg_c(l):              # CPU rows in, select per pair, reduce over k in fixed order
                d_rows.copy_(h_rows, non_blocking=True)
                sel = (ctl.outputs(st.P).pair_slot >= 0)[:, None]
                torch.where(sel, gpu_rows, d_rows, out=st.rows[l])
                st.combine(l, st.rows[l])
                if l + 1 < L:
                    seg_a(l + 1)       # the next layer's control step joins the same graph

            def token(graphs):
                graphs[L][0].replay() if graphs else seg_a(0)
                ev.record()
                for l in range(L):
                    graphs[l][0].replay() if graphs else seg_b(l)
                    ev.synchronize()    # control step done: the CPU works while fills + GPU run
                    cpu = h_ps[l] < 0
                    if bool(cpu.any()):
                        h_rows[cpu] = cpu_fn(h_x, bank.w13[l], bank.w2[l], st.h_tok[cpu], st.h_ids_in[l].view(-1)[cpu])
                    graphs[l][1].replay() if graphs else seg_c(l)
                    ev.record()

    ids_dev = ids.to(CUDA)
    st.load_ids(ids_dev, ids, 0)
    token(None)                                            # compiles every kernel; first warm token
    torch.cuda.synchronize()
    if policy in ("lru+q*", "lru+sync"):
        graphs = [[_capture(lambda f=f, l=l: f(l)) for f in (seg_b, seg_c)] for l in range(L)]
        graphs.append([_capture(lambda: seg_a(0))])
    elif policy == "static" and n_gpu == 0:
        graphs = None
    else:
        graphs = _capture(gpu_layers)
    for t in range(1, warm):
        st.load_ids(ids_dev, ids, t)
        token(graphs)
    torch.cuda.synchronize()
    before = ctl.counters() if ctl else None
    t0 = time.perf_counter()
    for t in range(warm, n_tok):
        st.load_ids(ids_dev, ids, t)
        token(graphs)
    torch.cuda.synchronize()
    secs = (time.perf_counter() - t0) / (n_tok - warm)
    if not torch.isfinite(st.x[L].float()).all():
        raise RuntimeError(f"{policy}: non-finite hidden state")
    # bandwidth-model bound for this row's measured counts
    hbm, pcie, cpu_b = bw["hbm_copy_gbps"] * 1e9, bw["pcie_h2d_gbps"] * 1e9, bw["cpu_expert_gbps"] * 1e9
    d_meas = distinct[warm:].float()
    shared_t = L * bank.shared_bytes * 1.0 / hbm
    res = {"policy": policy, "cache_slots": slots, "cache_fraction": slots / (L * E), "seconds_per_step": secs,
           "tok_s": batch / secs}
    if policy in ("all", "static"):
        n_gpu_l = slots // E
        bound = (d_meas[:, :n_gpu_l].sum() * se / hbm + d_meas[:, n_gpu_l:].sum() * se / cpu_b) / (n_tok - warm)
        res.update(miss_rate=float(d_meas[:, n_gpu_l:].sum() / d_meas.sum()), fills_per_step=0.0,
                   cpu_experts_per_step=float(d_meas[:, n_gpu_l:].sum()) / (n_tok - warm), gpu_layers=n_gpu_l)
    else:
        after = ctl.counters()
        c = {key: after[key] - before[key] for key in after}
        steps = n_tok - warm
        if policy in ("lru", "lru+sync"):
            bound = (c["fills"] * se / pcie + (c["hits"] + c["fills"]) * se / hbm) / steps
        else:
            # the misses split ideally between PCIe and the CPU, both at their concurrent rates
            both = (bw["concurrent_pcie_h2d_gbps"] + bw["concurrent_cpu_expert_gbps"]) * 1e9
            bound = (c["misses"] * se / both + (c["hits"] + c["fills"]) * se / hbm) / steps
        res.update(miss_rate=c["misses"] / max(c["hits"] + c["misses"], 1), fills_per_step=c["fills"] / steps,
                   cpu_experts_per_step=c["cpu_computed"] / steps, fill_fraction=ctl.fill_fraction)
    bound = float(bound) + shared_t
    res.update(bound_tok_s=batch / bound, fraction_of_bound=bound / secs)
    del ctl
    torch.cuda.empty_cache()
    return res


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one model, one budget, few tokens (smoke test)")
    ap.add_argument("--models", default="qwen3-30b-a3b,qwen3.6-35b-a3b")
    ap.add_argument("--budgets", default="8,16,32")
    ap.add_argument("--policies", default="all,static,lru,lru+q*")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill rows")
    ap.add_argument("--no-tune", action="store_true", help="keep the default decode tiles")
    ap.add_argument("--out", default=str(ROOT / "bench/results/gpu_offload.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    from freetoken_engine.kernels import cpu_expert_forward
    cpu_name, cpu_fn = cpu_expert_forward()
    result = {"benchmark": "gpu_offload", "hardware": hardware(), "cpu_expert_backend": cpu_name,
              "method": __doc__, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "routing_locality": routing_params(ROOT), "bandwidth": {}, "decode": [], "prefill": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(result, indent=1))

    names = args.models.split(",")[:1] if args.quick else args.models.split(",")
    budgets = [16.0] if args.quick else [float(b) for b in args.budgets.split(",")]
    for name in names:
        model = MODELS[name]
        t0 = time.time()
        bank = Bank(model)
        print(f"[{name}] bank {bank.bytes / 1e9:.1f} GB pinned in {time.time() - t0:.0f} s", flush=True)
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
        for seq in [] if args.no_prefill else ([8192] if args.quick else [4096, 8192, 16384]):
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
        tokens = {1: (6, 8) if args.quick else (12, 16), 4: (4, 4) if args.quick else (6, 8)}
        for routing in ("locality", "uniform"):
            for batch in (1, 4):
                warm, meas = tokens[batch]
                ids = make_routing(model, warm + meas, batch, routing, result["routing_locality"], seed=batch)
                policies = args.policies.split(",")
                plans = [("all", None)] if "all" in policies else []
                plans += [(p, b) for b in budgets for p in ("static", "lru", "lru+q*", "lru+sync") if p in policies]
                for policy, budget in plans:
                    slots = bank.total_experts if budget is None else cache_slots(budget, model)
                    try:
                        row = decode_row(bank, policy, slots, ids, warm, bw, cpu_fn)
                    except Exception as exc:  # keep the other rows: record the failure in the results
                        row = {"policy": policy, "cache_slots": slots, "error": repr(exc), "tok_s": 0.0,
                               "miss_rate": 0.0, "bound_tok_s": 0.0, "fraction_of_bound": 0.0}
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                    row.update(model=name, routing=routing, batch=batch, budget_gib=budget)
                    result["decode"].append(row)
                    print(f"[{name}] {routing:8s} b{batch} {policy:7s} {str(budget):5s} slots {slots:6d} "
                          f"{row['tok_s']:8.2f} tok/s miss {row['miss_rate']:.3f} bound {row['bound_tok_s']:8.2f} "
                          f"({row['fraction_of_bound']:.2f})", flush=True)
                    save()
        bank.free()
        del bank
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save()
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(result["bandwidth"])
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(6 * (len(models) + 1), 4.5))
    axes = list(axes) if len(models) else [axes]
    colors = {"all": "k", "static": "tab:red", "lru": "tab:blue", "lru+q*": "tab:green"}
    for ax, name in zip(axes, models):
        rows = [r for r in result["decode"] if r["model"] == name and r["routing"] == "locality" and r["batch"] == 1]
        budgets = sorted({r["budget_gib"] for r in rows if r["budget_gib"] is not None})
        for i, pol in enumerate(("static", "lru", "lru+q*")):
            sel = [next((r for r in rows if r["policy"] == pol and r["budget_gib"] == b), None) for b in budgets]
            xs = [j + 0.25 * (i - 1) for j in range(len(budgets))]
            ax.bar(xs, [r["tok_s"] if r else 0 for r in sel], 0.25, color=colors[pol], label=pol)
            ax.scatter(xs, [r["bound_tok_s"] if r else 0 for r in sel], marker="_", s=300, color="k")
        allr = next((r for r in rows if r["policy"] == "all"), None)
        if allr:
            ax.axhline(allr["tok_s"], color="k", ls="--", label=f"all resident {allr['tok_s']:.0f}")
        ax.set_xticks(range(len(budgets)), [f"{b:g} GB card" for b in budgets])
        ax.set_yscale("log")
        ax.set_title(f"{name} decode, batch 1, locality routing\n(bars measured, '-' bandwidth bound)")
        ax.set_ylabel("tok/s (MoE layers only)")
        ax.legend(fontsize=8)
    ax = axes[-1]
    for name in models:
        for mode, ls in (("double", "-"), ("single", ":")):
            rows = [r for r in result["prefill"] if r["model"] == name and r["mode"] == mode]
            if not rows:
                continue
            ax.plot([r["tokens"] for r in rows], [r["tok_s"] for r in rows], ls, marker="o", label=f"{name} {mode}")
        rows = [r for r in result["prefill"] if r["model"] == name and r["mode"] == "double"]
        ax.plot([r["tokens"] for r in rows], [r["tokens"] / r["bound_seconds"] for r in rows], "k--", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_title("prefill (dashed: PCIe bound)")
    ax.set_xlabel("tokens")
    ax.set_ylabel("tok/s")
    ax.legend(fontsize=8)
    fig.suptitle(f"{result['hardware']['gpu']}, {result['hardware']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
