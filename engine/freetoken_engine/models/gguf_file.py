"""A GGUF file's metadata and tensor table, read in one pass (little-endian, versions 2 and 3).

Contract:

    f = GGUFFile(path)          # raises GGUFError for a missing, truncated or non-GGUF file
    f.metadata                  # {key: int | float | bool | str | list}, plus GGUF.version,
                                # GGUF.tensor_count and GGUF.kv_count, as gguf.GGUFReader's
                                # ``fields[k].contents()`` gives them
    f.tensors                   # [GGUFTensor(name, ne, qtype, raw)], in file order; qtype a
                                # gguf.GGMLQuantizationType
    t.raw                       # the tensor's bytes (a read-only view of the mapped file): float32
                                # or float16 elements for F32 / F16, else uint8 rows of
                                # ne[0] // block quantized blocks, as gguf.quants.dequantize takes

Why not ``gguf.GGUFReader``: it builds a NumPy view per value, and the 98 k strings of a
tokenizer's vocabulary and merges took it 5.6 s on the default model's file (this module:
about 0.1 s). The `gguf` package still supplies the quantization table and the dequantizers.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gguf.constants import GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types -> little-endian format, for struct (a value) and NumPy (an array) alike;
# 8 STRING and 9 ARRAY are read apart
_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}


class GGUFError(ValueError):
    """The file is missing, unreadable, or not a llama-architecture GGUF."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ne: tuple[int, ...]      # GGUF's dimension order: ne[0] (a row's elements) first
    qtype: GGMLQuantizationType
    raw: np.ndarray


class _Cursor:
    def __init__(self, buf, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"GGUF file {self.path} is truncated (its header runs past the end at byte {self.pos})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"GGUF file {self.path} is truncated (a string runs past the end at byte {self.pos})")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFError(f"GGUF file {self.path}: a string at byte {self.pos - n} is not UTF-8") from exc

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype in _FORMATS:
            return self.take(_FORMATS[vtype])
        if vtype == 9:
            item, count = self.take("<I"), self.take("<Q")
            if item in _FORMATS:        # numbers and bools in one read
                width = struct.calcsize(_FORMATS[item])
                if self.pos + count * width > len(self.buf):
                    raise GGUFError(f"GGUF file {self.path} is truncated (an array runs past the end)")
                arr = np.frombuffer(self.buf, dtype=_FORMATS[item], count=count, offset=self.pos)
                self.pos += count * width
                return arr.tolist()
            return [self.value(item) for _ in range(count)]
        raise GGUFError(f"GGUF file {self.path}: unknown value type {vtype} at byte {self.pos}")


class GGUFFile:
    """See the module docstring."""

    def __init__(self, path: str | Path) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path = Path(path)
        if not path.is_file():
            raise GGUFError(f"GGUF file not found: {path}")
        try:
            with open(path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:      # ValueError: an empty file cannot be mapped
            raise GGUFError(f"cannot read GGUF file {path}: {exc}") from exc
        buf = memoryview(self._map)
        if bytes(buf[:4]) != MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        cur = _Cursor(buf, path)
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are; a big-endian "
                            "file reads as a huge version)")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        meta: dict = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            ne = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
            infos.append((name, ne, cur.take("<I"), cur.take("<Q")))
        align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or align < 1:
            raise GGUFError(f"{path}: general.alignment must be a positive integer, got {align!r}")
        start = -(-cur.pos // align) * align
        tensors = []
        for name, ne, qtype, offset in infos:
            try:
                qtype = GGMLQuantizationType(qtype)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (KeyError, ValueError):
                raise GGUFError(f"{path}: tensor {name} has unknown type {qtype}") from None
            if not ne or ne[0] % block:
                raise GGUFError(f"{path}: tensor {name} has shape {list(ne)}, not whole blocks of {block}")
            n = int(np.prod(ne, dtype=np.int64))
            nbytes = n // block * type_size
            at = start + offset
            if at + nbytes > len(buf):
                raise GGUFError(f"GGUF file {path} is truncated (tensor {name} ends at byte {at + nbytes}, "
                                f"the file at {len(buf)})")
            raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=at)
            if qtype == GGMLQuantizationType.F32:
                raw = raw.view(np.float32)
            elif qtype == GGMLQuantizationType.F16:
                raw = raw.view(np.float16)
            else:
                raw = raw.reshape(-1, ne[0] // block * type_size)
            tensors.append(GGUFTensor(name, ne, qtype, raw))
        self.metadata, self.tensors = meta, tensors
