"""Peak memory of turning a MoE GGUF file into a checkpoint folder, on this machine: the streamed
conversion (``models/gguf.convert_gguf``: one GGUF tensor dequantized at a time, a shard per
layer) against reading the whole file into memory first (``load_gguf`` + ``write_hf_folder``,
the only path before this stop). Each side in its own process (its peak resident memory is its
own), on one synthetic Qwen3-MoE file in llama.cpp's layout (``--layers`` layers of
``--experts`` experts of 512 x 1024, written by tests/engine/test_gguf_moe.write_gguf from a
random checkpoint, in ``--quant``). Reported: each side's peak RSS growth over its process's start, the seconds, the
file's size, and whether both folders hold the same tensors.

    python bench/gguf_convert_memory.py [--layers 8] [--experts 32] [--quant Q8_0]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "engine"))
from hardware import describe, peak_rss  # noqa: E402
from report import bars, parse, save  # noqa: E402

SIDES = ("streamed", "whole file")


def worker(path: Path, out: Path, side: str) -> dict:
    import torch  # noqa: F401  (imported before the baseline: both sides pay it alike)

    from freetoken_engine.models.gguf import convert_gguf, load_gguf, write_hf_folder
    base = peak_rss()
    t0 = time.perf_counter()
    if side == "streamed":
        convert_gguf(path, out)
    else:
        write_hf_folder(load_gguf(path, torch.float32), out)
    seconds = time.perf_counter() - t0
    return {"peak_growth_bytes": peak_rss() - base, "seconds": seconds}


def tensors(folder: Path) -> dict:
    from safetensors import safe_open
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def run(args) -> dict:
    from test_gguf_moe import write_gguf
    from tiny_models import make_tiny_checkpoint
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        tmp = Path(tmp)
        src = make_tiny_checkpoint(tmp / "src", "qwen3_moe", hidden_size=1024, moe_intermediate_size=512,
                                   num_experts=args.experts, num_experts_per_tok=8, num_hidden_layers=args.layers,
                                   num_attention_heads=16, num_key_value_heads=4, head_dim=128, init_std=0.02)
        path = write_gguf(src, tmp / "model.gguf", quant=args.quant)
        result = {"hardware": describe(), "layers": args.layers, "experts": args.experts, "quant": args.quant,
                  "file_bytes": path.stat().st_size, "sides": {}}
        for side in SIDES:
            out = tmp / side.replace(" ", "_")
            line = subprocess.run([sys.executable, __file__, "--worker", str(path), str(out), side],
                                  capture_output=True, text=True, env=dict(os.environ), check=True).stdout
            result["sides"][side] = json.loads(line.strip().splitlines()[-1])
        a, b = tensors(tmp / "streamed"), tensors(tmp / "whole_file")
        result["same_tensors"] = set(a) == set(b) and all(
            (a[k].float() - b[k].float()).abs().max() <= 2.0 ** -8 * b[k].float().abs().max() for k in a)
        result["streamed_dtype"] = str(next(iter(a.values())).dtype)
    s = result["sides"]
    result["peak_ratio"] = s["whole file"]["peak_growth_bytes"] / max(1, s["streamed"]["peak_growth_bytes"])
    return result


def plot(result: dict, path: Path) -> None:
    bars(path, SIDES, [result["sides"][s]["peak_growth_bytes"] / 1e9 for s in SIDES], "peak RSS growth, GB",
         f"GGUF ({result['file_bytes'] / 1e9:.2f} GB, {result['quant']}) to a folder: "
         f"{result['peak_ratio']:.1f}x less\n{result['hardware']['cpu']}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--quant", default="Q8_0")
    ap.add_argument("--tmp", default=None, help="where the file and folders are written (default: the system's)")
    parsed = parse(ap, ROOT / "bench" / "results" / "gguf_convert_memory.json", plot)
    if parsed is None:
        return
    args, out = parsed
    result = run(args)
    print(f"file {result['file_bytes'] / 1e9:.2f} GB ({result['quant']}, {result['layers']} layers of "
          f"{result['experts']} experts)")
    print(f"{'side':12s} {'peak RSS growth GB':>20s} {'seconds':>9s}")
    for side in SIDES:
        r = result["sides"][side]
        print(f"{side:12s} {r['peak_growth_bytes'] / 1e9:20.2f} {r['seconds']:9.1f}")
    print(f"streamed peak {result['peak_ratio']:.1f}x lower; same tensors: {result['same_tensors']} "
          f"(streamed folder in {result['streamed_dtype']}); {result['hardware']['cpu']}")
    save(result, out, plot)


if __name__ == "__main__":
    main()
