"""``convert(model_dir, out_dir)``: a Hugging Face safetensors folder -> the packed format.

Reads the checkpoint through the engine's own loader (``models.loader.Checkpoint``, family key
names), writes the bank in its final layout (``w13[l, e] = cat(gate, up)``, ``w2[l, e] = down``)
split into files of about ``shard_bytes`` by MoE layer, every non-expert tensor 4 KiB-aligned in
``dense-*.bin``, CRC32 per 16 MiB block, then copies every other file of the folder (config,
tokenizer, chat template, generation config). Writes into a hidden sibling folder and renames
it into place at the end, so an interrupted convert leaves no half-written output.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import torch

from ..kernels.mxfp4_rows import ROW_ALIGN, row_bytes
from .format import ALIGN, BLOCK, FORMAT, INDEX_NAME, VERSION, PackedFormatError, dtype_name, is_packed

log = logging.getLogger(__name__)
SHARD_BYTES = 2 << 30


class _BlockFile:
    """A file written sequentially with a CRC32 per BLOCK bytes and 4 KiB padding on close."""

    def __init__(self, path: Path):
        self.path, self.fh = path, open(path, "wb", buffering=8 << 20)
        self.pos, self.crcs, self.crc = 0, [], 0

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            room = BLOCK - self.pos % BLOCK
            part, mv = mv[:room], mv[room:]
            self.fh.write(part)
            self.crc = zlib.crc32(part, self.crc)
            self.pos += len(part)
            if self.pos % BLOCK == 0:
                self.crcs.append(self.crc)
                self.crc = 0

    def pad(self) -> None:
        if self.pos % ALIGN:
            self.write(bytes(ALIGN - self.pos % ALIGN))

    def close(self) -> dict:
        self.pad()
        if self.pos % BLOCK:
            self.crcs.append(self.crc)
        self.fh.close()
        return {"size": self.pos, "crc32": self.crcs}


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, show: bool):
    """A tqdm progress bar over tensors and bank layers (silent without tqdm or when not shown)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="part", desc="convert", disable=not show)


def _raw(t: torch.Tensor):
    """The bytes of a tensor, without a copy when it is already contiguous."""
    return t.contiguous().view(torch.uint8).numpy()


def convert(model_dir: str | Path, out_dir: str | Path, shard_bytes: int = SHARD_BYTES,
            progress: bool = True, expert_format: str = "auto") -> Path:
    """Write the packed form of ``model_dir`` (a checkpoint folder, or a GGUF file) to ``out_dir``
    (which must not exist or be empty). ``expert_format``: experts published in MXFP4 stay in 4
    bits (``auto``; ``mxfp4``: or fail saying why not) or are dequantized (``dense``: what a GPU
    runs fastest today, docs/gpu.md).

    Raises ``ConfigError`` for a bad source folder (as the safetensors loader would) and
    ``PackedFormatError`` for an output folder in the way. Returns ``out_dir``.
    """
    from ..models import family
    from ..models.loader import Checkpoint

    src, out = Path(model_dir), Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PackedFormatError(f"output folder {out} exists and is not empty")
    if src.suffix == ".gguf" and src.is_file():          # a GGUF file: its converted folder (cached)
        from ..models.gguf_folder import gguf_folder
        src = gguf_folder(src)
    if is_packed(src):
        raise PackedFormatError(f"{src} is already a packed folder (freetoken convert's output): "
                                "--model takes it as it is")
    ckpt = Checkpoint(src)
    fam = family(ckpt.config.get("model_type"))
    cfg = fam.parse(ckpt.config)
    expert_keys = set()
    moe = cfg.moe
    # the MTP layer's routed experts go to the bank's last layer (its other tensors are dense)
    mtp = bool(moe and cfg.mtp_layers and fam.has_mtp(cfg, ckpt.names()))
    layers = [*moe.layers, *([fam.mtp_layer(cfg)] if mtp else [])] if moe else []
    if moe:
        expert_keys = {fam.expert_key(layer, e, p) for layer in layers
                       for e in range(moe.num_experts) for p in range(3)}
        expert_keys.update(k for layer in layers for k in fam.fused_expert_keys(layer))
    dense_keys = [k for k in ckpt.names() if k not in expert_keys and not (fam.skip and fam.skip(cfg, k))]
    shape = (cfg.hidden_size, moe.intermediate_size) if moe else None
    probe = next(fam.layer_experts(ckpt, moe.layers[0], moe.num_experts, shape))[0] if moe else ckpt.get(dense_keys[0])
    dtype = probe.dtype
    # experts published in MXFP4 (gpt-oss) stay in 4 bits: the engine's rows, repacked exactly
    if expert_format not in ("auto", "mxfp4", "dense"):
        raise PackedFormatError(f"expert_format must be auto, mxfp4 or dense, got {expert_format!r}")
    four = expert_format != "dense" and bool(moe) and not mtp and cfg.residual_multiplier == 1.0 and \
        fam.stores_expert_rows(ckpt, moe.layers[0], shape)
    if expert_format == "mxfp4" and not four:
        raise PackedFormatError(f"{src} holds no MXFP4 experts to keep in 4 bits (gpt-oss's published checkpoints "
                                f"do): convert with --expert-format auto or dense")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as exc:
        raise PackedFormatError(f"cannot write the output folder {out}: {exc.strerror}") from None
    t0 = time.perf_counter()
    try:
        index = {"format": FORMAT, "version": VERSION, "alignment": ALIGN, "block_bytes": BLOCK,
                 "dtype": dtype_name(dtype), "model_type": cfg.model_type, "source": str(src.resolve()),
                 "tensors": {}, "files": {}}
        bar = _bar(len(dense_keys) + len(layers), progress)
        _write_dense(ckpt, dense_keys, tmp, shard_bytes, index, bar)
        if moe:
            _write_bank(ckpt, fam, moe, layers, cfg.hidden_size, dtype, tmp, shard_bytes, index, bar,
                        cfg.residual_multiplier, four)
        bar.close()
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n")
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        ckpt.close()
    size = sum(m["size"] for m in index["files"].values())
    log.info("packed %s -> %s: %.2f GB in %.1f s", src, out, size / 1e9, time.perf_counter() - t0)
    return out


def _write_dense(ckpt, keys: list[str], tmp: Path, shard_bytes: int, index: dict, bar) -> None:
    shard, f = -1, None
    for key in keys:
        t = ckpt.get(key)
        nbytes = t.numel() * t.element_size()
        if f is None or (f.pos > 0 and f.pos + nbytes > shard_bytes):
            if f is not None:
                index["files"][f.path.name] = f.close()
            shard += 1
            f = _BlockFile(tmp / f"dense-{shard:05d}.bin")
        f.pad()
        index["tensors"][key] = {"file": f.path.name, "offset": f.pos, "nbytes": nbytes,
                                 "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        f.write(_raw(t))
        bar.update(1)
    if f is not None:
        index["files"][f.path.name] = f.close()


def _write_bank(ckpt, fam, moe, layers: list, hidden: int, dtype: torch.dtype, tmp: Path, shard_bytes: int,
                index: dict, bar, down_scale: float, four: bool = False) -> None:
    """The bank's layers: ``layers`` (the MoE layers' indices, then an MTP layer's key prefix),
    each expert's down weight times ``down_scale`` (folded: ``ModelConfig.residual_multiplier``;
    the dense tensors are kept as read and folded as they are loaded). ``four``: the experts as
    MXFP4 rows (``Family.layer_expert_rows``; the index's bank ``format`` "mxfp4")."""
    E, inter, L = moe.num_experts, moe.intermediate_size, len(layers)
    es = torch.empty(0, dtype=dtype).element_size()
    per_layer = E * 2 * inter * (row_bytes(hidden) if four else hidden * es)    # one layer of w13
    step = max(1, shard_bytes // per_layer)
    index["bank"] = {"moe_layers": list(moe.layers), "mtp_layers": L - len(moe.layers), "num_experts": E,
                     "hidden": hidden, "inter": inter, "format": "mxfp4" if four else "dense", "pieces": []}
    if four:
        index["bank"]["row_align"] = ROW_ALIGN
    for a in range(0, L, step):
        b = min(L, a + step)
        f13 = _BlockFile(tmp / f"bank-w13-{a:05d}.bin")
        f2 = _BlockFile(tmp / f"bank-w2-{a:05d}.bin")
        for li in range(a, b):
            layer = layers[li]
            if four:
                rows = fam.layer_expert_rows(ckpt, layer, E, (hidden, inter))
                if rows is None:
                    raise PackedFormatError(f"layer {layer}'s experts are not MXFP4 as the first layer's are")
                for w13, w2 in rows:
                    f13.write(_raw(w13.contiguous()))
                    f2.write(_raw(w2.contiguous()))
                bar.update(1)
                continue
            for e, (gate, up, down) in enumerate(fam.layer_experts(ckpt, layer, E, (hidden, inter), down_scale)):
                if gate.shape != (inter, hidden) or up.shape != (inter, hidden) or down.shape != (hidden, inter):
                    raise PackedFormatError(f"expert {e} of layer {layer}: shapes {tuple(gate.shape)}, "
                                            f"{tuple(down.shape)}; config implies {(inter, hidden)}")
                if gate.dtype != dtype or up.dtype != dtype or down.dtype != dtype:
                    raise PackedFormatError(f"expert {e} of layer {layer} is {gate.dtype}, the bank is {dtype}")
                f13.write(_raw(gate))
                f13.write(_raw(up))
                f2.write(_raw(down))
            bar.update(1)
        for f, name in ((f13, "w13"), (f2, "w2")):
            index["files"][f.path.name] = f.close()
            index["bank"]["pieces"].append({"tensor": name, "layers": [a, b], "file": f.path.name})
