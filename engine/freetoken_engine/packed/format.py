"""The packed index: its schema, and the structural checks run before any memory is allocated.

Index (``freetoken-packed.json``)::

    {"format": "freetoken-packed", "version": 1, "alignment": 4096, "block_bytes": 16777216,
     "dtype": "bfloat16", "model_type": "qwen3_moe",
     "bank": {"moe_layers": [..], "mtp_layers": 0 or 1, "num_experts": E, "hidden": H, "inter": I,
              "format": "dense" (in dtype; the default) | "mxfp4" (kernels/mxfp4.py's rows),
              "row_align": 16 (mxfp4 only: its rows' padding; unpadded rows are refused),
              "pieces": [{"tensor": "w13"|"w2", "layers": [a, b], "file": NAME}]},
     "tensors": {KEY: {"file": NAME, "offset": N, "nbytes": N, "dtype": "bfloat16", "shape": [..]}},
     "files": {NAME: {"size": N, "crc32": [one per block_bytes block]}}}

A bank piece file holds ``tensor[a:b]`` of the bank as raw bytes from offset 0.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from ..kernels.mxfp4_rows import ROW_ALIGN, row_bytes

INDEX_NAME = "freetoken-packed.json"
FORMAT = "freetoken-packed"
VERSION = 1
ALIGN = 4096
BLOCK = 16 << 20                 # CRC block and read chunk
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}   # the stored dtypes; no torch here, so a
# read can start (packed/early.py) before torch is imported


class PackedFormatError(ConfigError):
    """A packed folder that is missing, corrupt or inconsistent; raised before the model is used."""


def dtype_name(dt) -> str:
    """The stored name of torch dtype ``dt``."""
    name = str(dt).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise PackedFormatError(f"dtype {dt} cannot be packed (supported: {', '.join(ITEMSIZE)})")
    return name


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def is_packed(folder: str | Path) -> bool:
    """True when ``folder`` holds a packed index (it may still fail validation)."""
    return (Path(folder) / INDEX_NAME).is_file()


def bank_layers(bank: dict) -> int:
    """Layers of a packed bank: the MoE layers, then the MTP layer's experts when it was packed."""
    return len(bank["moe_layers"]) + int(bank.get("mtp_layers", 0))


def bank_mxfp4(bank: dict) -> bool:
    """Whether a packed bank holds its experts as MXFP4 rows (kernels/mxfp4.py: a row of K values
    in mxfp4.row_bytes(K) bytes), as gpt-oss publishes them, instead of the index's dtype."""
    return bank.get("format", "dense") == "mxfp4"


def bank_piece_bytes(index: dict, tensor: str, layers: tuple[int, int]) -> int:
    b = index["bank"]
    if tensor not in ("w13", "w2"):
        raise PackedFormatError(f"unknown bank tensor {tensor!r}")
    E, I, H = b["num_experts"], b["inter"], b["hidden"]
    if bank_mxfp4(b):                       # rows of mxfp4.row_bytes(K) bytes
        per_layer = E * (2 * I * row_bytes(H) if tensor == "w13" else H * row_bytes(I))
    else:
        per_layer = E * 2 * I * H * ITEMSIZE[index["dtype"]] // (1 if tensor == "w13" else 2)
    return per_layer * (layers[1] - layers[0])


def read_index(folder: Path) -> dict:
    """Parse and validate the index against the files on disk; raises PackedFormatError.

    Checks: format and version, dtype, every file present with the recorded size and CRC list,
    every tensor inside its file and 4 KiB-aligned, bank pieces covering every MoE layer of w13
    and w2 exactly once with the sizes the shapes imply.
    """
    path = folder / INDEX_NAME
    try:
        index = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PackedFormatError(f"{path}: unreadable packed index ({exc})") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise PackedFormatError(f"{path}: not a {FORMAT} v{VERSION} index "
                                f"(format={index.get('format')!r}, version={index.get('version')!r})")
    if index.get("dtype") not in ITEMSIZE:
        raise PackedFormatError(f"{path}: unknown dtype {index.get('dtype')!r}")
    bank = index.get("bank") or {}
    if bank.get("format", "dense") not in ("dense", "mxfp4") or (bank_mxfp4(bank) and (bank["hidden"] % 32
                                                                                        or bank["inter"] % 32)):
        raise PackedFormatError(f"{path}: bank format {bank.get('format')!r} for hidden {bank.get('hidden')} and "
                                f"inter {bank.get('inter')}: dense, or mxfp4 with both multiples of 32")
    if bank_mxfp4(bank) and bank.get("row_align") != ROW_ALIGN:
        raise PackedFormatError(f"{path}: its 4-bit expert rows are not padded to {ROW_ALIGN} bytes (an earlier "
                                f"freetoken wrote them); run `freetoken convert` on the checkpoint again")
    block = index.get("block_bytes")
    if not isinstance(block, int) or block <= 0 or block % ALIGN:
        raise PackedFormatError(f"{path}: bad block_bytes {block!r}")
    files = index.get("files", {})
    for name, meta in files.items():
        f = folder / name
        if not f.is_file():
            raise PackedFormatError(f"{folder}: missing packed file {name}")
        size = f.stat().st_size
        if size != meta["size"]:
            raise PackedFormatError(f"{f}: {size} bytes on disk, index says {meta['size']} (truncated or replaced?)")
        if len(meta["crc32"]) != (size + block - 1) // block:
            raise PackedFormatError(f"{path}: {name} has {len(meta['crc32'])} checksums for {size} bytes")
    for key, t in index.get("tensors", {}).items():
        if t["file"] not in files:
            raise PackedFormatError(f"{path}: tensor {key} lives in unlisted file {t['file']}")
        if t["offset"] % ALIGN or t["offset"] + t["nbytes"] > files[t["file"]]["size"]:
            raise PackedFormatError(f"{path}: tensor {key} is misaligned or runs past its file")
        if t["dtype"] not in ITEMSIZE:
            raise PackedFormatError(f"{path}: tensor {key} has unknown dtype {t['dtype']!r}")
        numel = 1
        for d in t["shape"]:
            numel *= d
        if numel * ITEMSIZE[t["dtype"]] != t["nbytes"]:
            raise PackedFormatError(f"{path}: tensor {key}: shape {t['shape']} does not match {t['nbytes']} bytes")
    bank = index.get("bank")
    if bank:
        n_layers = bank_layers(bank)
        for tensor in ("w13", "w2"):
            covered = sorted(tuple(p["layers"]) for p in bank["pieces"] if p["tensor"] == tensor)
            at = 0
            for a, b in covered:
                if a != at or b <= a:
                    raise PackedFormatError(f"{path}: bank {tensor} pieces do not tile layers 0..{n_layers}")
                at = b
            if at != n_layers:
                raise PackedFormatError(f"{path}: bank {tensor} pieces cover {at} of {n_layers} MoE layers")
        for p in bank["pieces"]:
            need = bank_piece_bytes(index, p["tensor"], tuple(p["layers"]))
            if p["file"] not in files or files[p["file"]]["size"] < need:
                raise PackedFormatError(f"{path}: bank piece {p['file']} is missing or shorter than {need} bytes")
    return index
