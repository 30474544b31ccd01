"""Read a Hugging Face checkpoint folder exactly as published on the hub.

``Checkpoint`` validates the folder up front (config.json, every shard named by
``model.safetensors.index.json`` present and readable, headers consistent with the file sizes)
so that a broken folder fails with one clear ``ConfigError`` before any weight is copied.
Tensors are then read lazily by name.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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

    def names(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        path = self._where.get(name)
        if path is None:
            raise ConfigError(f"checkpoint {self.folder} lacks tensor {name}")
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(str(path), framework="pt")
        return handle.get_tensor(name)

    def close(self) -> None:
        self._handles.clear()
