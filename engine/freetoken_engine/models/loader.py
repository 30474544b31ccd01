"""Read a Hugging Face checkpoint folder exactly as published on the hub.

``Checkpoint`` validates the folder up front (config.json, every shard named by
``model.safetensors.index.json`` present and readable, headers consistent with the file sizes)
so that a broken folder fails with one clear ``ConfigError`` before any weight is copied.
Tensors are then read lazily by name.

FP8 checkpoints are dequantized as each tensor is read, into the checkpoint's own dtype
(``torch_dtype``, bfloat16 for these): ``get`` returns weight times scale, and the scale tensors
are not among ``names``. Two layouts: Qwen's, GLM's and DeepSeek's (``quant_method: fp8``: e4m3
weights, a float32 ``<name>_scale_inv`` per ``weight_block_size`` block of the last two
dimensions) and llm-compressor's (``compressed-tensors`` with 8-bit float weights, as the
"FP8-dynamic" checkpoints are made: ``<name>_scale`` per output channel, per tensor or per block;
static activation scales, ``input_scale``, are unread: activations stay in the model's dtype).
MXFP4 checkpoints (``quant_method: mxfp4``, gpt-oss as published) store some tensors as
``<name>_blocks [..., rows, G, 16]`` (two 4-bit e2m1 values a byte, the low nibble first) and
``<name>_scales [..., rows, G]`` (a power of two per 32 values, biased by 127): ``names`` lists
``<name>`` in their place and ``get`` returns it dequantized, ``[..., rows, 32 G]`` in the
checkpoint's dtype. Other quantization methods are refused by name.
"""
from __future__ import annotations

import functools
import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
#: safetensors' dtype names -> torch's
_STORED = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_SCALE, _COMPRESSED_SCALE = "_scale_inv", "_scale"    # an FP8 tensor's scales: <name><suffix>


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def _check_shard(path: Path) -> list[str]:
    """Return the tensor names of one shard, or raise if it is missing or truncated."""
    if not path.is_file():
        raise ConfigError(f"missing weight shard {path}")
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            header_len = struct.unpack("<Q", fh.read(8))[0]
            if header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(fh.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"weight shard {path} is not a valid safetensors file ({exc})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise ConfigError(f"weight shard {path} is truncated: {size} bytes, header needs {8 + header_len + end}")
    return [k for k in header if k != "__metadata__"]


class Checkpoint:
    """A validated checkpoint folder; ``get(name)`` reads one tensor in its stored dtype."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if self.folder.is_file():
            raise ConfigError(f"{self.folder} is a file, not a model folder: --model takes a Hugging Face "
                              f"folder, a folder written by 'freetoken convert' or a .gguf file")
        if not self.folder.is_dir():
            raise ConfigError(f"model folder {self.folder} does not exist")
        cfg_path = self.folder / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{self.folder} has no config.json: is it a Hugging Face model folder?")
        try:
            self.config: dict = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{cfg_path} is not valid JSON: {exc}") from None
        self._where: dict[str, Path] = {}
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ConfigError(f"{index} is broken: {exc}") from None
            shards = sorted(set(weight_map.values()))
        else:
            shards = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not shards:
                raise ConfigError(f"{self.folder} holds no *.safetensors weights")
            weight_map = None
        for shard in shards:
            for name in _check_shard(self.folder / shard):
                self._where[name] = self.folder / shard
        if weight_map is not None:
            missing = [k for k in weight_map if k not in self._where]
            if missing:
                raise ConfigError(f"index names tensors absent from their shards, e.g. {missing[0]}")
        self._handles: dict[Path, object] = {}
        self._mx_dtype = _mxfp4_dtype(self.config)
        self._mx = {n[:-len(_BLOCKS)] for n in self._where if self._mx_dtype is not None and n.endswith(_BLOCKS)
                    and n[:-len(_BLOCKS)] + _SCALES in self._where}
        self._block, self._fp8_dtype, self._scale = (None, None, _SCALE) if self._mx_dtype is not None else \
            _fp8_scheme(self.config, cfg_path)
        compressed = self._scale == _COMPRESSED_SCALE       # llm-compressor's: static input scales too
        self._scales = {n for n in self._where if (n.endswith(self._scale) and n[: -len(self._scale)] in self._where)
                        or (compressed and n.endswith(".input_scale"))}

    def names(self) -> list[str]:
        packed = {n + suffix for n in self._mx for suffix in (_BLOCKS, _SCALES)}
        return [n for n in self._where if n not in self._scales and n not in packed] + sorted(self._mx)

    def has(self, name: str) -> bool:
        return name in self._where or name in self._mx

    def is_mxfp4(self, name: str) -> bool:
        """Whether the checkpoint stores ``name`` in MXFP4 (nothing is read)."""
        return name in self._mx

    def mxfp4_rows(self, name: str) -> torch.Tensor | None:
        """``name`` as ``kernels/mxfp4.py``'s rows (uint8 ``[..., R, row_bytes(32 G)]``, repacked exactly from
        its blocks and scales) when the checkpoint stores it in MXFP4; None when it does not."""
        if name not in self._mx:
            return None
        from ..kernels.mxfp4 import from_blocks
        return from_blocks(self.get(name + _BLOCKS), self.get(name + _SCALES))

    def dtype(self, name: str) -> torch.dtype:
        """The dtype ``get(name)`` returns, from its shard's header (nothing is read)."""
        if name in self._mx:
            return self._mx_dtype
        stored = self._open(name)[1].get_slice(name).get_dtype()
        return self._fp8_dtype if stored.startswith("F8") and self._fp8_dtype is not None else _STORED[stored]

    def _open(self, name: str):
        """``name``'s shard and its open handle (ConfigError when no shard has it)."""
        path = self._where.get(name)
        if path is None:
            raise ConfigError(f"checkpoint {self.folder} lacks tensor {name}")
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(str(path), framework="pt")
        return path, handle

    def get(self, name: str) -> torch.Tensor:
        if name in self._mx:
            return dequantize_mxfp4(self.get(name + _BLOCKS), self.get(name + _SCALES), self._mx_dtype)
        path, handle = self._open(name)
        t = handle.get_tensor(name)
        if t.dtype not in _FP8:
            return t
        scale = name + self._scale
        if self._fp8_dtype is None or scale not in self._where:
            raise ConfigError(f"{name} in {path.name} is float8 without its scales ({scale}) and an fp8 "
                              f"quantization_config in config.json: not a checkpoint the engine can read")
        return dequantize(t, self.get(scale), self._block, self._fp8_dtype)

    def close(self) -> None:
        self._handles.clear()


_BLOCKS, _SCALES = "_blocks", "_scales"
#: the 16 values of a 4-bit e2m1 float (MXFP4's elements)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _quant(config: dict) -> dict:
    return config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}


def _mxfp4_dtype(config: dict) -> torch.dtype | None:
    """The dtype an MXFP4 checkpoint's packed tensors dequantize into; None for any other."""
    if str(_quant(config).get("quant_method", "")).lower() != "mxfp4":
        return None
    return _DTYPES.get(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), torch.bfloat16)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 ``blocks [..., G, 16]`` (uint8, two e2m1 values a byte, low nibble first) times
    ``2 ** (scales [..., G] - 127)`` -> ``[..., 32 G]`` in ``dtype``, exact (every product is a
    float32 value). A matrix of rows at a time, so a layer's temporaries stay small."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != 16 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ConfigError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                          f"{scales.dtype} do not fit: expected uint8 [..., G, 16] and uint8 [..., G]")
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    groups = scales.shape[-1]
    out = torch.empty((*scales.shape[:-1], groups * 32), dtype=dtype)
    flat_b, flat_s, flat_o = blocks.reshape(-1, groups, 16), scales.reshape(-1, groups), out.view(-1, groups * 32)
    step = max(1, (1 << 22) // (groups * 32))          # rows a pass: ~4M values
    for r0 in range(0, flat_b.shape[0], step):
        b = flat_b[r0:r0 + step].to(torch.int64)
        vals = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).view(b.shape[0], groups, 32)
        vals = torch.ldexp(vals, flat_s[r0:r0 + step].to(torch.int32)[..., None] - 127)
        flat_o[r0:r0 + step] = vals.view(b.shape[0], -1)
    return out


def _fp8_scheme(config: dict, where: Path) -> tuple[tuple[int, int] | None, torch.dtype | None, str]:
    """(block size or None: told by the scales' shape, the dtype FP8 tensors dequantize into,
    the scale tensors' suffix); (None, None, ``_scale_inv``) for a checkpoint that is not
    quantized; a ConfigError names a quantization the engine cannot read."""
    quant = _quant(config)
    if not quant:
        return None, None, _SCALE
    method = str(quant.get("quant_method", "?")).lower()
    dtype = _DTYPES.get(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), torch.bfloat16)
    if method == "compressed-tensors":
        weights = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values()]
        if weights and all(w.get("type") == "float" and int(w.get("num_bits", 0)) == 8 for w in weights):
            blocks = {tuple(w["block_structure"]) for w in weights if w.get("block_structure")}
            return (tuple(int(b) for b in next(iter(blocks))) if len(blocks) == 1 else None), dtype, _COMPRESSED_SCALE
        kinds = ", ".join(sorted({f"{w.get('type', '?')}{w.get('num_bits', '?')}" for w in weights})) or "?"
        raise ConfigError(f"{where}: compressed-tensors weights of {kinds} are not supported; the engine reads "
                          f"unquantized checkpoints and 8-bit float (FP8) ones")
    if method != "fp8" or str(quant.get("fmt", "e4m3")).lower() != "e4m3":
        raise ConfigError(f"{where}: quantization_config {method!r} (fmt {quant.get('fmt', '-')!r}) is not supported; "
                          f"the engine reads unquantized (bfloat16 / float16 / float32) checkpoints, FP8 "
                          f"(e4m3, block-scaled) ones and MXFP4 ones (gpt-oss)")
    block = quant.get("weight_block_size")
    return (tuple(int(b) for b in block) if block else None), dtype, _SCALE


@functools.cache
def _fp8_values(dtype: torch.dtype) -> torch.Tensor:
    """The 256 values of an FP8 dtype in float32, as a ``[256, 1]`` lookup table."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()[:, None]


def _as_float(w: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor in float32 through a table of its 256 values (about twice torch's own
    conversion on the CPU, which is most of a dequantization's time)."""
    return torch.nn.functional.embedding(w.view(torch.uint8).to(torch.int32), _fp8_values(w.dtype)).view(w.shape)


def dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 tensor times its scales, in ``dtype``: ``scale`` holds one float per ``block`` of the
    last two dimensions (ceil-divided: the last blocks may be partial), or one for all. Stacked
    experts go a matrix at a time, scaled in place, so each stays in cache: 2-5x the plain float32
    expression on a 2-CPU VM, 0.67-0.88 G weights/s, the same bits (``bench/fp8_dequant.py``)."""
    n, k = w.shape[-2:]
    if scale.numel() == 1:
        return (_as_float(w) * scale.float().reshape(())).to(dtype)
    bn, bk = block or (-(-n // scale.shape[-2]), -(-k // scale.shape[-1]))
    if scale.shape[:-2] != w.shape[:-2] or scale.shape[-2:] != (-(-n // bn), -(-k // bk)):
        raise ConfigError(f"FP8 scales of shape {tuple(scale.shape)} do not fit a weight of shape {tuple(w.shape)} "
                          f"in blocks of {bn}x{bk}")
    out = torch.empty(w.shape, dtype=dtype)
    weights, scales = w.reshape(-1, n, k), scale.float().reshape(-1, *scale.shape[-2:])
    for i, matrix in enumerate(out.view(-1, n, k)):
        x = _as_float(weights[i])
        if n % bn == 0 and k % bk == 0:
            x.view(n // bn, bn, k // bk, bk).mul_(scales[i][:, None, :, None])
        else:
            x.mul_(scales[i].repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k])
        matrix.copy_(x)
    return out
