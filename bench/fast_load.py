"""Time to ready: a safetensors folder vs the packed format, against the disk's own read speed.

Workload: a synthetic Qwen3-MoE checkpoint in the hub layout (H 2048, 128 experts of I 768, bf16,
``--layers`` MoE layers: 1.21 GB of experts per layer) written with safetensors; then
``freetoken convert`` (``packed.convert``) of it. Sides, each after dropping the page cache
(``echo 3 > /proc/sys/vm/drop_caches``; the JSON says whether that worked):

* disk: ``dd iflag=direct bs=16M`` over the packed files (one stream), and a parallel O_DIRECT
  read of the same bytes (``--threads`` threads, 16 MiB blocks, no checksum): the ceilings;
  the same parallel read into fresh memory shows what first-touch page faults add (a floor
  for any load, large on VMs);
* safetensors -> ready: the engine's ``models.build.build_model`` (dense tensors into the model,
  experts into the bank one by one, bank pinned after fill when CUDA exists);
* packed -> ready: the loader alone, ``load_packed`` with each option the engine does not
  expose, the model's parameters aliasing the packed arena: pin after fill, a first load
  (every block's CRC checked) and a restart (``verify="auto"``: files unchanged since a verified
  load, CRC skipped); pin before fill as a variant. Pinning exists only where CUDA does: on a
  CPU machine the pin variants are not run;
* packed -> ready through the engine's own ``build_model`` (what ``freetoken serve`` does: a
  restart, dense tensors copied into the model, pin after fill).

    python bench/fast_load.py --label cpu-2core --dir /tmp/ft-fastload [--layers 4] [--threads 8]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_expert_kernel import hardware  # noqa: E402
from disk_read import dd_read, drop_caches, parallel_direct_read  # noqa: E402
from fast_restart import first_request, plot_restarts  # noqa: E402

from freetoken_engine.models import family  # noqa: E402
from freetoken_engine.packed import convert, load_packed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
H, I, E, VOCAB = 2048, 768, 128, 32000


#: the benches' model shapes (config.json entries over the common ones): Qwen3-30B-A3B, and
#: Qwen3.6-35B-A3B's MoE layers (256 experts of I 512, top-8, one sigmoid-gated shared expert of
#: 512) carried by the qwen2_moe family, with Qwen2-MoE's attention (16 heads of 128, 2 KV heads)
SHAPES = {
    "qwen3-30b": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 32,
                  "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": I, "num_experts": E},
    "qwen3.6": {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "num_attention_heads": 16,
                "num_key_value_heads": 2, "moe_intermediate_size": 512, "num_experts": 256,
                "shared_expert_intermediate_size": 512},
    # Qwen3.6-35B-A3B whole: three Gated DeltaNet layers to one gated attention layer (head 256,
    # a quarter of it rotated), the same MoE layers
    # a hybrid model small enough for a 2-CPU machine's benches (Qwen3.6's layer kinds, H 1024)
    "hybrid-small": {"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"], "hidden_size": 1024,
                     "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
                     "moe_intermediate_size": 512, "num_experts": 64, "shared_expert_intermediate_size": 512,
                     "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 64,
                     "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "full_attention_interval": 4},
    "qwen3.6-hybrid": {"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
                       "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                       "moe_intermediate_size": 512, "num_experts": 256, "shared_expert_intermediate_size": 512,
                       "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                       "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
                       "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                       "max_position_embeddings": 65536},
    # the new families' MoE layers, every layer sparse (the published models' one dense first layer
    # left out, so that a stretched checkpoint repeats MoE layers); a 32000-token vocabulary:
    # ERNIE-4.5-21B-A3B (64 experts of I 1536, top 6, softmax choice with the correction bias,
    # two shared experts, 20/4 heads of 128, H 2560)
    "ernie4.5-21b": {"model_type": "ernie4_5_moe", "architectures": ["Ernie4_5_MoeForCausalLM"], "hidden_size": 2560,
                     "num_attention_heads": 20, "num_key_value_heads": 4, "head_dim": 128,
                     "moe_intermediate_size": 1536, "moe_num_experts": 64, "moe_k": 6, "moe_num_shared_experts": 2,
                     "moe_layer_start_index": 0, "intermediate_size": 12288},
    # GLM-4.5-Air (128 experts of I 1408, top 8, sigmoid choice with the correction bias, one
    # shared expert, 96/8 heads of 128 with q/k/v biases, half-rotary, H 4096)
    "glm4.5-air": {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 4096,
                   "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "attention_bias": True,
                   "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
                   "first_k_dense_replace": 0, "routed_scaling_factor": 1.0, "partial_rotary_factor": 0.5,
                   "intermediate_size": 10944},
    # gpt-oss-20b (32 experts of I 2880, top 4, gate/up and down biases, the clamped gate, sinks,
    # sliding layers beside full ones, 64/8 heads of 64 with q/k/v/o biases, H 2880)
    "gpt-oss-20b": {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 2880,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
                    "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128, "attention_bias": True},
}
#: layers a stretched checkpoint repeats (a hybrid model's period of layer kinds)
PERIOD = {"qwen3.6-hybrid": 4}


def write_checkpoint(folder: Path, layers: int, rnd=None, shape: str = "qwen3-30b", mtp: bool = False,
                     vocab: int = VOCAB) -> int:
    """A hub-layout folder of ``SHAPES[shape]``, one safetensors shard per layer; returns bytes
    written. ``rnd(shape)`` makes each bf16 tensor (default: finite random bit patterns, the
    cheapest to make). ``mtp``: with a multi-token-prediction layer (``mtp.*``, a hybrid shape)."""
    from freetoken_engine.layers.rope import Rotary
    from freetoken_engine.models.decoder import DecoderLM
    cfg_raw = {"hidden_size": H, "num_hidden_layers": layers, "intermediate_size": 6144, "num_experts_per_tok": 8,
               "norm_topk_prob": True, "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
               "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
               **SHAPES[shape], **({"mtp_num_hidden_layers": 1} if mtp else {})}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg_raw))
    fam = family(cfg_raw["model_type"])
    cfg = dataclasses.replace(fam.parse(cfg_raw), use_mtp=mtp)
    n_exp, inter, hid = cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.hidden_size
    with torch.device("meta"):
        model = DecoderLM(cfg, Rotary(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings, "meta"))
    # random bit patterns with the exponent's top bit cleared: finite, |x| < 2 (NaN weights would
    # make every hidden state NaN and route every token to the same experts)
    rnd = rnd or (lambda shape: torch.empty(shape, dtype=torch.int16).random_(-16000, 16000)
                  .bitwise_and_(~0x4000).view(torch.bfloat16))
    # under the checkpoint's names (the family's ``source``: GLM's shared_experts, ERNIE's
    # moe_statics); a correction bias of zeros, so that a replayed routing picks what it traces
    dense = {_checkpoint_name(fam, cfg, k): torch.zeros(p.shape, dtype=torch.bfloat16)
             if k.endswith("e_score_correction_bias") else rnd(p.shape) for k, p in model.named_parameters()}
    weight_map, total = {}, 0
    shards = [("dense", dense)] + [(f"layer{i}", {fam.expert_key(i, e, p): rnd((inter, hid) if p < 2 else (hid, inter))
                                                  for e in range(n_exp) for p in range(3)})
                                   for i in [*cfg.moe.layers, *(["mtp.layers.0"] if mtp else [])]]
    for n, (tag, tensors) in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += (folder / name).stat().st_size
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


def _checkpoint_name(fam, cfg, name: str) -> str:
    how = fam.source(cfg, name) if fam.source is not None else None
    return how[0] if how else name


def ready_from_packed(folder: Path, pin: str, verify: bool, threads: int):
    """load_packed with the given options, the model's parameters aliasing the packed arena."""
    from freetoken_engine.cache.bank import ExpertBank
    from freetoken_engine.layers.rope import Rotary
    from freetoken_engine.models.decoder import DecoderLM
    pm = load_packed(folder, torch.bfloat16, threads=threads, pin=pin, verify=verify)
    fam = family(pm.config["model_type"])
    cfg = fam.parse(pm.config)
    rotary = Rotary(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings, torch.device("cpu"))
    with torch.device("meta"):
        model = DecoderLM(cfg, rotary).to(torch.bfloat16)   # dtype on meta: no fp32 detour
    by_engine = {fam.rename(k): k for k in pm.names()}
    for prefix, mod in model.named_modules():  # CPU, same dtype: parameters alias the packed arena
        for name, _ in list(mod.named_parameters(recurse=False)):
            src = pm.get(by_engine[f"{prefix}.{name}" if prefix else name])
            mod.register_parameter(name, torch.nn.Parameter(src, requires_grad=False))
    if any(t.is_meta for t in model.buffers()):
        raise RuntimeError("model has buffers that the packed folder does not provide")
    bank = ExpertBank(len(cfg.moe.layers), cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size, torch.bfloat16)
    bank.w13, bank.w2 = pm.bank_tensors()
    bank.pinned = pm.pinned
    pm.close()
    return model, bank, pm.stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default=os.uname().nodename)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ft-fastload"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--keep", action="store_true", help="keep the synthetic folders")
    ap.add_argument("--first-request-only", action="store_true",
                    help="only the restart -> first request measurement; added to this label's entry")
    ap.add_argument("--entry", default="first_request",
                    help="with --first-request-only: the key of this label's entry that gets the result")
    ap.add_argument("--restarts", default="plain,preload,plain+warm,preload+warm,plain+warm,preload+warm",
                    help="the restarts after the first start, in order: plain | preload[:threads], "
                         "each optionally with restart_probe.py's /switches, then +warm (libraries "
                         "imported after the page cache is dropped) or +hot (only the folder evicted)")
    ap.add_argument("--pycache", type=Path,
                    help="restarts keep Python's bytecode here (PYTHONPYCACHEPREFIX): for a Python "
                         "install without .pyc files that cannot be written to")
    args = ap.parse_args()
    from freetoken_engine.models.build import build_model

    cuda = torch.cuda.is_available()
    st_dir, pk_dir = args.dir / "safetensors", args.dir / "packed"
    shutil.rmtree(args.dir, ignore_errors=True)
    t0 = time.perf_counter()
    st_bytes = write_checkpoint(st_dir, args.layers)
    t_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    convert(st_dir, pk_dir, progress=False)
    t_convert = time.perf_counter() - t0
    files = sorted(pk_dir.glob("*.bin"))
    pk_bytes = sum(f.stat().st_size for f in files)
    out = RESULTS / "fast_load.json"
    if args.first_request_only:
        shutil.rmtree(st_dir, ignore_errors=True)     # the disk holds one large folder at a time
        data = json.loads(out.read_text())
        data["machines"].setdefault(args.label, {})[args.entry] = {
            "moe_layers": args.layers, "packed_bytes": pk_bytes, **first_request(pk_dir, args.threads, args.restarts.split(","), args.pycache)}
        out.write_text(json.dumps(data, indent=1) + "\n")
        try:
            plot_restarts(data["machines"][args.label][args.entry], f"{args.label} {args.entry}: "
                          f"restarts of a {pk_bytes / 1e9:.1f} GB packed folder", RESULTS / f"fast_load_{args.label}_{args.entry}.png")
        except ImportError as exc:  # matplotlib absent (the GPU machine): the JSON is what counts
            print(f"no plot: {exc}")
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
        return
    print(f"synthetic checkpoint: {st_bytes / 1e9:.2f} GB safetensors (written in {t_write:.1f} s), "
          f"{pk_bytes / 1e9:.2f} GB packed (convert {t_convert:.1f} s); CUDA: {cuda}")

    rows, dropped = [], []

    def side(name: str, nbytes: int, fn) -> None:
        """Time fn from a cold page cache; fn returns (what it built, extra fields). Freeing
        what it built happens after the clock stops."""
        dropped.append(drop_caches())
        t = time.perf_counter()
        built, extra = fn()
        dt = time.perf_counter() - t
        del built
        rows.append({"side": name, "seconds": dt, "gbps": nbytes / dt / 1e9, "page_cache_dropped": dropped[-1], **extra})
        print(f"{name:66s} {dt:7.2f} s {nbytes / dt / 1e9:7.2f} GB/s  {extra}")

    keep = []

    def st_ready():
        model, bank, _ = build_model(st_dir, torch.bfloat16, torch.device("cpu"))
        if bank.pinned:
            # ExpertBank.pin() never unregisters: freeing the bank would leave a stale
            # registration that a later allocation at the same address trips over. Keep it.
            keep.append(bank)
        return (model, bank), {"bank_pinned": bool(bank.pinned)}

    def pk_ready(pin: str, verify: bool):
        model, bank, stats = ready_from_packed(pk_dir, pin, verify, args.threads)
        return (model, bank), {k: stats[k] for k in ("read_seconds", "pin_seconds", "direct_bytes")}

    side("disk: dd bs=16M, one stream", pk_bytes, lambda: (None, {"mode": dd_read(files)[1]}))
    side(f"disk: parallel O_DIRECT read, {args.threads} threads", pk_bytes,
         lambda: (parallel_direct_read(files, args.threads), {}))
    side("disk: same, into fresh memory (page faults)", pk_bytes,
         lambda: (parallel_direct_read(files, args.threads, fresh=True), {}))
    side("safetensors -> ready (build_model)", st_bytes, st_ready)
    for label, pin, verify in (("packed -> ready, first load: CRC checked, pin after fill", "after", True),
                               ("packed -> ready, restart: verify=auto skips CRC, pin after fill", "after", "auto"),
                               ("packed -> ready, first load: CRC checked, pin before fill", "before", True)):
        if pin == "before" and not cuda:
            print(f"{label}: skipped (no CUDA here: nothing can be pinned)")
            continue
        side(label, pk_bytes, lambda: pk_ready(pin, verify))

    def engine_ready():
        model, bank, _ = build_model(pk_dir, torch.bfloat16, torch.device("cpu"))
        if bank.pinned:
            keep.append(bank)
        return (model, bank), {"bank_pinned": bool(bank.pinned)}
    side("packed -> ready, the engine's build_model (restart, pin after fill)", pk_bytes, engine_ready)
    disk = max(r["gbps"] for r in rows if r["side"].startswith("disk") and "fresh" not in r["side"])
    fresh = next(r["gbps"] for r in rows if "fresh" in r["side"])
    first = next(r for r in rows if "first load" in r["side"] and "pin after" in r["side"])
    restart = next(r for r in rows if "restart" in r["side"])
    st = next(r for r in rows if r["side"].startswith("safetensors"))
    headline = {"disk_gbps": disk, "disk_into_fresh_memory_gbps": fresh, "target": 0.8,
                "packed_restart_gbps": restart["gbps"], "packed_restart_fraction_of_disk": restart["gbps"] / disk,
                "packed_first_load_gbps": first["gbps"], "packed_first_load_fraction_of_disk": first["gbps"] / disk,
                "safetensors_seconds": st["seconds"], "packed_restart_seconds": restart["seconds"],
                "packed_first_load_seconds": first["seconds"], "speedup_restart": st["seconds"] / restart["seconds"],
                "engine_build_model_fraction_of_disk": rows[-1]["gbps"] / disk}
    print(f"\npacked restart loads at {100 * headline['packed_restart_fraction_of_disk']:.0f}% of the disk's "
          f"{disk:.2f} GB/s (target 80%; first load with CRC {100 * headline['packed_first_load_fraction_of_disk']:.0f}%); "
          f"{headline['speedup_restart']:.1f}x faster to ready than safetensors")
    entry = {"hardware": hardware(), "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "cuda": cuda, "page_cache_dropped": all(dropped), "disk_dir": str(args.dir),
             "df": subprocess.run(["df", "-hT", str(args.dir)], capture_output=True, text=True).stdout.strip(),
             "checkpoint": {"moe_layers": args.layers, "experts": E, "hidden": H, "inter": I, "vocab": VOCAB,
                            "safetensors_bytes": st_bytes, "packed_bytes": pk_bytes, "convert_seconds": t_convert},
             "threads": args.threads, "rows": rows, "headline": headline,
             "first_request": {"moe_layers": args.layers, "packed_bytes": pk_bytes,
                               **first_request(pk_dir, args.threads, args.restarts.split(","), args.pycache)},
             "notes": [] if cuda else ["no CUDA on this machine: the bank is not pinned, the pin-before-fill side is not run"]}
    data = json.loads(out.read_text()) if out.exists() else {}
    data.update({"benchmark": "fast_load", "method": __doc__.strip().split("\n\n")[1]})
    data.setdefault("machines", {})[args.label] = entry
    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    try:
        plot(data, RESULTS / "fast_load.png")
    except ImportError as exc:  # matplotlib absent (e.g. the GPU machine): the JSON is what counts
        print(f"no plot: {exc}")
    print(f"wrote {out}")
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    machines = data["machines"]
    fig, axes = plt.subplots(len(machines), 1, figsize=(10, 3.2 * len(machines)), squeeze=False)
    for ax, (label, m) in zip(axes[:, 0], machines.items()):
        rows = m["rows"]
        ax.barh(range(len(rows)), [r["gbps"] for r in rows],
                color=["gray" if r["side"].startswith("disk") else "tab:orange" if "safetensors" in r["side"] else "tab:blue"
                       for r in rows])
        ax.set_yticks(range(len(rows)), [f"{r['side']} ({r['seconds']:.1f} s)" for r in rows], fontsize=7)
        ax.axvline(0.8 * m["headline"]["disk_gbps"], color="g", ls=":", label="80% of disk read")
        ck = m["checkpoint"]
        ax.set_title(f"{label}: {ck['packed_bytes'] / 1e9:.1f} GB checkpoint, cache dropped: {m['page_cache_dropped']}",
                     fontsize=9)
        ax.set_xlabel("GB/s (checkpoint bytes / time to ready)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
