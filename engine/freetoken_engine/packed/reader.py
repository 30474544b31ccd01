"""``load_packed``: read a packed folder straight into a page-aligned expert bank.

Order of work, so a bad folder never yields a half-loaded model:
1. the index and every file are checked structurally (``format.read_index``) and config.json is
   checked against the bank shapes, before any memory is allocated;
2. the bank (``w13 [L_moe, E, 2I, H]``, ``w2 [L_moe, E, H, I]``) and one arena per dense file are
   allocated page-aligned (anonymous mmap, transparent huge pages advised), pinned first only
   when ``pin="before"`` is asked for (the benchmark's comparison);
3. 16 MiB blocks are read by ``threads`` threads with ``os.preadv`` (GIL released), through an
   O_DIRECT descriptor when the filesystem takes one and the block is aligned, into their final
   place; each block's CRC32 is checked as it lands. ``verify="auto"`` (default) checks the
   first load of a folder and records its files' (size, mtime, inode) in the engine cache; later
   loads of unchanged files (an engine restart) skip the CRC pass, which costs CPU that a small
   machine does not have spare; any change to a file brings the check back. ``True`` always
   checks, ``False`` never;
4. with ``pin="after"`` (default) and CUDA present, the bank is page-locked in place.
Any failure raises ``PackedFormatError`` naming the file and block; nothing is returned.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .format import ALIGN, DTYPES, INDEX_NAME, PackedFormatError, read_index
from .memory import aligned_empty, host_register


@dataclass
class PackedModel:
    """A loaded packed folder. Offers the ``models.loader.Checkpoint`` interface for the
    non-expert tensors (checkpoint key names, stored dtype) plus the filled bank."""

    folder: Path
    config: dict
    index: dict
    tensors: dict[str, torch.Tensor]
    w13: torch.Tensor | None            # [L_moe, E, 2I, H], requested dtype, page-aligned
    w2: torch.Tensor | None             # [L_moe, E, H, I]
    moe_layers: tuple[int, ...]
    pinned: bool = False
    stats: dict = field(default_factory=dict)

    def names(self) -> list[str]:
        return list(self.tensors)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise PackedFormatError(f"packed folder {self.folder} lacks tensor {name}")
        return self.tensors[name]

    def close(self) -> None:
        self.tensors.clear()

    def bank_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w13, self.w2


def _check_config(folder: Path, index: dict) -> dict:
    from ..models import family
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PackedFormatError(f"{folder}: config.json missing or broken ({exc})") from None
    cfg = family(config.get("model_type")).parse(config)
    b = index.get("bank")
    if bool(cfg.moe) != bool(b):
        raise PackedFormatError(f"{folder}: config.json and the packed index disagree on MoE layers")
    if b:
        have = (tuple(b["moe_layers"]), b["num_experts"], b["inter"], b["hidden"])
        want = (tuple(cfg.moe.layers), cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.hidden_size)
        if have != want:
            raise PackedFormatError(f"{folder}: bank (layers, experts, inter, hidden) {have} does not "
                                    f"match config.json {want}: was the folder packed from another model?")
    return config


class _Reader:
    """Parallel block reads with O_DIRECT where possible and CRC checks; one per load."""

    def __init__(self, folder: Path, index: dict, verify: bool, direct: bool,
                 progress: Callable[[float], None] | None):
        self.folder, self.index, self.verify = folder, index, verify
        self.block = index["block_bytes"]
        self.fds: dict[str, tuple[int, int | None]] = {}
        for name in index["files"]:
            path = str(folder / name)
            fd = os.open(path, os.O_RDONLY)
            dfd = None
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                except OSError:
                    dfd = None          # e.g. tmpfs: no O_DIRECT, the page cache it is
            self.fds[name] = (fd, dfd)
        self.total = sum(m["size"] for m in index["files"].values())
        self.done, self.direct_bytes = 0, 0
        self.lock = threading.Lock()
        self.progress, self.last = progress, -1.0

    def close(self) -> None:
        for fd, dfd in self.fds.values():
            os.close(fd)
            if dfd is not None:
                os.close(dfd)

    def _pread(self, fd: int, dest: memoryview, off: int) -> None:
        got = 0
        while got < len(dest):
            n = os.preadv(fd, [dest[got:]], off + got)
            if n <= 0:
                raise PackedFormatError(f"short read at offset {off + got}")
            got += n

    def read_file(self, name: str, dest: torch.Tensor) -> list[tuple]:
        """Jobs reading file ``name`` into the uint8 tensor ``dest`` (its first len(dest) bytes;
        file bytes past ``dest``, the alignment padding, are read for the CRC only)."""
        size = self.index["files"][name]["size"]
        return [(name, b, dest) for b in range((size + self.block - 1) // self.block)]

    def run_job(self, job: tuple) -> None:
        name, b, dest = job
        meta = self.index["files"][name]
        fd, dfd = self.fds[name]
        off = b * self.block
        n = min(self.block, meta["size"] - off)
        inside = max(0, min(n, dest.numel() - off))
        try:
            if inside == n:
                mv = memoryview(dest[off:off + n].numpy())
                addr = dest.data_ptr() + off
                use_direct = dfd is not None and off % ALIGN == 0 and n % ALIGN == 0 and addr % ALIGN == 0
                try:
                    self._pread(dfd if use_direct else fd, mv, off)
                except OSError:
                    if not use_direct:
                        raise
                    use_direct = False
                    self._pread(fd, mv, off)
            else:                       # the padded tail past dest: bounce it
                buf = bytearray(n)
                self._pread(fd, memoryview(buf), off)
                mv = memoryview(buf)
                if inside:
                    dest[off:off + inside].copy_(torch.frombuffer(buf, dtype=torch.uint8)[:inside])
                use_direct = False
        except OSError as exc:
            raise PackedFormatError(f"{self.folder / name}: read failed at block {b} ({exc})") from None
        if self.verify and zlib.crc32(mv) != meta["crc32"][b]:
            raise PackedFormatError(f"{self.folder / name}: block {b} (bytes {off}..{off + n}) fails its "
                                    f"CRC32 check: the file is corrupt; re-run freetoken convert")
        with self.lock:
            self.done += n
            self.direct_bytes += n if use_direct else 0
            frac = self.done / max(1, self.total)
            if self.progress and (frac - self.last >= 0.01 or frac >= 1.0):
                self.last = frac
                self.progress(frac)


def _stamp_path(folder: Path) -> Path:
    from .. import env
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:24]
    return env.cache_dir() / "packed-verified" / f"{key}.json"


def _file_stamps(folder: Path, index: dict) -> dict:
    stamps = {}
    for name in sorted(index["files"]) + [INDEX_NAME]:
        st = (folder / name).stat()
        stamps[name] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return stamps


def _already_verified(folder: Path, index: dict) -> bool:
    try:
        return json.loads(_stamp_path(folder).read_text()) == _file_stamps(folder, index)
    except (OSError, ValueError):
        return False


def _record_verified(folder: Path, index: dict) -> None:
    path = _stamp_path(folder)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_file_stamps(folder, index)))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs a re-check next time


def load_packed(folder: str | Path, dtype: torch.dtype | None = None, *, threads: int = 8,
                pin: str = "after", verify: bool | str = "auto", direct: bool = True,
                progress: Callable[[float], None] | None = None) -> PackedModel:
    """Load a packed folder (see the module docstring). ``dtype``: the bank's dtype (default:
    the stored one; another dtype costs a conversion pass). ``pin``: "after" | "before" | "none"
    (pinning only happens when CUDA is present). ``verify``: "auto" | True | False (module
    docstring). Raises ``PackedFormatError``."""
    if pin not in ("after", "before", "none"):
        raise ValueError(f"pin must be 'after', 'before' or 'none', got {pin!r}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if verify not in (True, False, "auto"):
        raise ValueError(f"verify must be True, False or 'auto', got {verify!r}")
    folder = Path(folder)
    t0 = time.perf_counter()
    index = read_index(folder)
    config = _check_config(folder, index)
    stored = DTYPES[index["dtype"]]
    dtype = dtype or stored
    check = verify is True or (verify == "auto" and not _already_verified(folder, index))
    reader = _Reader(folder, index, check, direct, progress)
    try:
        jobs, arenas, tensors = [], {}, {}
        for name, meta in index["files"].items():
            if name.startswith("dense-"):
                arenas[name] = aligned_empty(meta["size"])
                jobs += reader.read_file(name, arenas[name])
        bank = index.get("bank")
        w13 = w2 = None
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        if bank:
            L, E, H, I = len(bank["moe_layers"]), bank["num_experts"], bank["hidden"], bank["inter"]
            es = torch.empty(0, dtype=dtype).element_size()
            w13 = aligned_empty(L * E * 2 * I * H * es).view(dtype).view(L, E, 2 * I, H)
            w2 = aligned_empty(L * E * H * I * es).view(dtype).view(L, E, H, I)
            for p in bank["pieces"]:
                a, b = p["layers"]
                target = (w13 if p["tensor"] == "w13" else w2)[a:b]
                if dtype == stored:
                    dest = target.view(-1).view(torch.uint8)
                else:                   # read the stored dtype, convert after the reads
                    dest = aligned_empty(target.numel() * DTYPES[index["dtype"]].itemsize)
                    staged.append((dest, target))
                jobs += reader.read_file(p["file"], dest)
        pinned = False
        if pin == "before" and bank:
            pinned = host_register(w13) and host_register(w2)
        t_read = time.perf_counter()
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for f in [pool.submit(reader.run_job, j) for j in jobs]:
                f.result()              # the first failure propagates; the rest is dropped
        t_read = time.perf_counter() - t_read
        for src, target in staged:
            target.copy_(src.view(stored).view(target.shape))
        for key, t in index["tensors"].items():
            arena = arenas[t["file"]]
            tensors[key] = arena[t["offset"]:t["offset"] + t["nbytes"]].view(DTYPES[t["dtype"]]).view(t["shape"])
        t_pin = time.perf_counter()
        if pin == "after" and bank:
            pinned = host_register(w13) and host_register(w2)
        t_pin = time.perf_counter() - t_pin
    finally:
        reader.close()
    if check:
        _record_verified(folder, index)
    stats = {"bytes": reader.total, "seconds": time.perf_counter() - t0, "read_seconds": t_read,
             "pin_seconds": t_pin, "direct_bytes": reader.direct_bytes, "threads": threads,
             "verified": check}
    return PackedModel(folder, config, index, tensors, w13, w2,
                       tuple(bank["moe_layers"]) if bank else (), pinned, stats)
