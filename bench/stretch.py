"""A deep checkpoint for timing runs without its bytes on disk: a 2-layer packed folder whose
layers are repeated (4 layers for a hybrid model: its period of three Gated DeltaNet layers and
an attention layer).

A 48-layer model in Qwen3-30B-A3B's shapes is about 60 GB, more than the GPU machine's disk
holds beside everything else. Timing does not need 48 different layers, only 48 layers' worth
of bytes moving: ``stretched_checkpoint`` writes a 2-layer checkpoint (``fast_load.write_checkpoint``),
packs it with ``freetoken convert``'s writer, and builds an N-layer packed folder in which layer
i's dense tensors are index entries pointing at layer i % 2's bytes and every pair of layers'
bank piece is a hard link to the one piece file. The engine loads it like any packed folder:
N layers of experts in its host bank (N/2 x the piece's bytes read), N layers of attention on
the GPU. Outputs are those of a model whose layers repeat, which is all a timing run needs.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from freetoken_engine.packed.format import INDEX_NAME


def stretch_packed(src: Path, dst: Path, layers: int) -> int:
    """``dst``: an N-layer packed folder over ``src``'s (one bank piece per tensor covering all its
    n MoE layers; N a multiple of n). Returns the bytes the engine will read."""
    index = json.loads((src / INDEX_NAME).read_text())
    bank = index["bank"]
    n = len(bank["moe_layers"])
    pieces = {p["tensor"]: p for p in bank["pieces"]}
    if layers % n or sorted(pieces) != ["w13", "w2"] or any(p["layers"] != [0, n] for p in pieces.values()):
        raise ValueError(f"{src}: want one piece per bank tensor over {n} layers and N a multiple of {n}")
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "config.json":
            config = json.loads(f.read_text())
            config["num_hidden_layers"] = layers
            (dst / f.name).write_text(json.dumps(config))
        elif f.name != INDEX_NAME and not f.name.startswith("bank-"):
            os.link(f, dst / f.name)
    tensors = {}
    for key, t in index["tensors"].items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
        if m is None:
            tensors[key] = t
        else:
            tensors.update({f"model.layers.{i}.{m[2]}": t for i in range(int(m[1]), layers, n)})
    files = {k: v for k, v in index["files"].items() if not k.startswith("bank-")}
    new_pieces = []
    for a in range(0, layers, n):
        for name, p in pieces.items():
            fname = f"bank-{name}-{a:05d}.bin"
            os.link(src / p["file"], dst / fname)
            files[fname] = index["files"][p["file"]]
            new_pieces.append({"tensor": name, "layers": [a, a + n], "file": fname})
    index.update(tensors=tensors, files=files, bank={**bank, "moe_layers": list(range(layers)), "pieces": new_pieces})
    (dst / INDEX_NAME).write_text(json.dumps(index))
    return sum(files[p["file"]]["size"] for p in new_pieces) + sum(
        v["size"] for k, v in files.items() if not k.startswith("bank-"))


def stretched_checkpoint(work: Path, fast: Path, layers: int, rnd, shape: str = "qwen3-30b") -> tuple[Path, int]:
    """Write the 2-layer checkpoint under ``work``, pack it under ``fast`` (a RAM-backed folder such
    as /dev/shm keeps loads off the disk; hard links there share pages), stretch it to ``layers``
    layers beside it; the safetensors copy is deleted. Returns (folder, bytes the engine reads)."""
    from fast_load import PERIOD, write_checkpoint

    from freetoken_engine.packed.writer import convert
    n = PERIOD.get(shape, 2)
    write_checkpoint(work / f"hf{n}", n, rnd=rnd, shape=shape)
    convert(work / f"hf{n}", fast / f"packed-{n}-layers", shard_bytes=1 << 40, progress=False)   # one bank piece
    shutil.rmtree(work / f"hf{n}")
    return fast / f"packed{layers}", stretch_packed(fast / f"packed-{n}-layers", fast / f"packed{layers}", layers)


def bench_checkpoint(work: Path, layers: int, fast: Path | None = None, shape: str = "qwen3-30b") -> tuple[Path, int]:
    """The engine benches' checkpoint: random bf16 weights (normal, std 0.02, seed 0) in the
    shapes ``fast_load.SHAPES[shape]`` (default Qwen3-30B-A3B's), ``layers`` layers; a safetensors
    folder under ``work``, or with ``fast`` the stretched packed one there
    (``stretched_checkpoint``). -> (folder, bytes)."""
    import torch
    from fast_load import write_checkpoint
    gen = torch.Generator().manual_seed(0)

    def rnd(shape):
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    if fast is not None:
        return stretched_checkpoint(work, fast, layers, rnd, shape)
    return work / "model", write_checkpoint(work / "model", layers, rnd=rnd, shape=shape)
