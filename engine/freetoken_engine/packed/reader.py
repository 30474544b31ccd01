"""``load_packed``: read a packed folder straight into a page-aligned expert bank.

Order of work, so a bad folder never yields a half-loaded model:
1. the index and every file are checked structurally (``format.read_index``) and config.json is
   checked against the bank shapes, before any memory is allocated;
2. the bank (``w13 [L_moe, E, 2I, H]``, ``w2 [L_moe, E, H, I]``) and one arena per dense file are
   allocated page-aligned (anonymous mmap, transparent huge pages advised), pinned first only
   when ``pin="before"`` is asked for (the benchmark's comparison);
3. spans of ``early.SPAN`` 16 MiB blocks are read by ``threads`` threads (``early.Fill``) with one
   ``os.preadv`` each (GIL released), through an O_DIRECT descriptor when the filesystem takes
   one and the span is aligned, into their final place; each block's CRC32 is checked as it lands. A read that
   ``preload`` started before torch was imported (``early.py``) is taken over when its options
   match: the load then only waits for what is left of it. ``verify="auto"`` (default) checks the
   first load of a folder and records its files' (size, mtime, inode) in the engine cache; later
   loads of unchanged files (an engine restart) skip the CRC pass, which costs CPU that a small
   machine does not have spare; any change to a file brings the check back. ``True`` always
   checks, ``False`` never;
4. with ``pin="after"`` (default) and CUDA present, the bank is page-locked in place.
A restart that pins nothing (no CUDA, or ``pin="none"``) maps the bank's files instead of step
3's reads of them (``early.py``: the page cache becomes the bank; ``FREETOKEN_MAP_BANK=off``
reads them as above).
With ``defer_bank=True`` steps 3-4 finish in ``PackedModel.finish()``: the load returns once the
dense files are in, so the engine builds the model while the bank is still read.
Any failure raises ``PackedFormatError`` naming the file and block, from ``load_packed`` or, for
the bank's blocks of a deferred load, from ``finish()``; nothing half-read is returned as loaded.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import env
from . import early
from .early import already_verified, record_verified
from ..kernels.mxfp4_rows import row_bytes
from .format import PackedFormatError, bank_layers, bank_mxfp4, bank_piece_bytes, read_index
from .memory import aligned_empty, as_tensor, host_register
from .pinning import BankPins


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
    _pending: "_Pending | None" = None   # a defer_bank load's unfinished part

    def names(self) -> list[str]:
        return list(self.tensors)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise PackedFormatError(f"packed folder {self.folder} lacks tensor {name}")
        return self.tensors[name]

    def release_dense(self) -> None:
        """Drop the dense tensors (their memory goes once the caller's copies are made)."""
        self.tensors.clear()

    def close(self) -> None:
        """Drop the dense tensors; a bank still being read (``defer_bank``) is cancelled."""
        self.release_dense()
        if self._pending is not None:
            self._pending.fill.cancel()
            self._pending = None

    def bank_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The bank's tensors; with ``defer_bank`` their bytes are there only after ``finish``."""
        return self.w13, self.w2

    def pin_head(self) -> bool:
        """Register the first page of the bank's tensors now, while the bank is still read
        (``defer_bank`` with ``pin="after"``), so that kernels taking the bank as an argument
        can be launched and captured before it is in (``pinning.BankPins.head``). Nothing may
        read the bank's bytes before ``finish``. False where that is not possible (no CUDA, no
        deferred read, a tensor under a page)."""
        p = self._pending
        return p is not None and p.pins is not None and p.pins.head()

    def finish(self) -> None:
        """Wait for the rest of the read, convert the bank to the asked dtype, pin it (``pin=
        "after"``) and record a verified folder; nothing to do when it is done already. Raises
        the read's first failure (``PackedFormatError``).

        Pinning overlaps the read (``pinning.BankPins``): ``w13`` is page-locked as soon as all
        of its files are in, while ``w2`` is still read. If a registration fails the bank is left
        unpinned (``ExpertBank.pin`` takes over)."""
        p = self._pending
        if p is None:
            return
        self._pending = None
        t = time.perf_counter()
        pins = p.pins                   # None: nothing to pin (pin != "after", or no bank)
        if pins is not None and p.st13 is None:
            pins.as_read(p.fill, self.index)
        busy = pins.busy if pins is not None else 0.0
        read = p.fill.wait()
        t_read = time.perf_counter()
        if p.st13 is not None:
            self.w13.copy_(p.st13)
            self.w2.copy_(p.st2)
        if pins is not None:
            self.pinned = pins.rest()
        if p.fill.check:
            record_verified(self.folder, self.index)
        self.stats.update({"seconds": time.perf_counter() - p.t0, "read_seconds": read,
                           "waited_seconds": self.stats["waited_seconds"] + t_read - t - busy,
                           "pin_seconds": pins.busy if pins is not None else 0.0,
                           # from the read's last block: what the load cost beyond the read
                           "pin_after_read_seconds": time.perf_counter() - max(p.fill.finished, t),
                           "direct_bytes": p.fill.direct_bytes, "mapped_bytes": p.fill.mapped_bytes})


@dataclass
class _Pending:
    """What ``PackedModel.finish`` has left to do."""
    fill: early.Fill
    st13: torch.Tensor | None           # the bank as read, when another dtype was asked for
    st2: torch.Tensor | None
    t0: float
    pins: BankPins | None               # the bank's registrations (pin="after"), made while it is read


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


def load_packed(folder: str | Path, dtype: torch.dtype | None = None, *, threads: int = 8,
                pin: str = "after", verify: bool | str = "auto", direct: bool = True,
                progress: Callable[[float], None] | None = None, defer_bank: bool = False,
                index: dict | None = None) -> PackedModel:
    """Load a packed folder (see the module docstring). ``dtype``: the bank's dtype (default:
    the stored one; another dtype costs a conversion pass). ``pin``: "after" | "before" | "none"
    (pinning only happens when CUDA is present). ``verify``: "auto" | True | False (module
    docstring). ``defer_bank``: return once the dense files are in, the bank still being read;
    the caller puts the dense weights on the device meanwhile and calls ``finish()`` before it
    touches the bank (``close()`` cancels the read). ``index``: the folder's ``read_index``, when
    the caller has it already. Raises ``PackedFormatError``."""
    if pin not in ("after", "before", "none"):
        raise ValueError(f"pin must be 'after', 'before' or 'none', got {pin!r}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if verify not in (True, False, "auto"):
        raise ValueError(f"verify must be True, False or 'auto', got {verify!r}")
    from ..models.loader import torch_dtype
    folder = Path(folder)
    t0 = time.perf_counter()
    index = index or read_index(folder)        # a caller that read it already passes it on
    config = _check_config(folder, index)
    stored = torch_dtype(index["dtype"])
    dtype = dtype or stored
    check = verify is True or (verify == "auto" and not already_verified(folder, index))
    # a bank pinned for a GPU is read into anonymous memory; otherwise a restart maps it (early.py)
    will_pin = pin != "none" and torch.cuda.is_available()
    fill = early.take(folder)
    if fill is not None and (fill.index != index or fill.check != check or fill.direct != direct or pin == "before"
                             or (fill.mapped and will_pin)):
        fill.cancel()                   # read with other options (or files changed since): again
        fill = None
    preloaded = fill is not None
    bank = index.get("bank")
    w13 = w2 = st13 = st2 = None
    pinned = False
    try:
        if fill is None:
            fill = early.Fill(folder, index, check, direct, threads, progress,
                              mapped=not will_pin and env.map_bank())
        else:
            fill.progress = progress
        if bank and bank_mxfp4(bank):     # 4-bit rows: taken as they are, whatever the dtype
            L, E, H, I = bank_layers(bank), bank["num_experts"], bank["hidden"], bank["inter"]
            w13 = st13 = as_tensor(fill.arenas["w13"], bank_piece_bytes(index, "w13", (0, L))).view(
                L, E, 2 * I, row_bytes(H))
            w2 = st2 = as_tensor(fill.arenas["w2"], bank_piece_bytes(index, "w2", (0, L))).view(L, E, H, row_bytes(I))
            stored = dtype
        elif bank:
            L, E, H, I = bank_layers(bank), bank["num_experts"], bank["hidden"], bank["inter"]
            st13 = as_tensor(fill.arenas["w13"], L * E * 2 * I * H * stored.itemsize).view(stored).view(L, E, 2 * I, H)
            st2 = as_tensor(fill.arenas["w2"], L * E * H * I * stored.itemsize).view(stored).view(L, E, H, I)
            if dtype == stored:
                w13, w2 = st13, st2
            else:                       # read the stored dtype, convert after the reads
                w13 = aligned_empty(st13.numel() * dtype.itemsize).view(dtype).view(st13.shape)
                w2 = aligned_empty(st2.numel() * dtype.itemsize).view(dtype).view(st2.shape)
        if bank and pin == "before":
            pinned = bool(host_register(w13)) and bool(host_register(w2))
        if not preloaded:
            fill.start()
        t_wait = time.perf_counter()
        fill.wait_dense()
        t_wait = time.perf_counter() - t_wait
    except BaseException:
        if fill is not None and fill.started:
            fill.cancel()
        raise
    tensors, wholes = {}, {}
    for key, t in index["tensors"].items():
        if t["file"] not in wholes:
            wholes[t["file"]] = as_tensor(fill.arenas[t["file"]], index["files"][t["file"]]["size"])
        tensors[key] = wholes[t["file"]][t["offset"]:t["offset"] + t["nbytes"]].view(torch_dtype(t["dtype"])).view(t["shape"])
    stats = {"bytes": fill.total, "preloaded": preloaded, "threads": fill.threads, "verified": check,
             "waited_seconds": t_wait}
    pm = PackedModel(folder, config, index, tensors, w13, w2, tuple(bank["moe_layers"]) if bank else (),
                     pinned, stats)
    pm._pending = _Pending(fill, st13 if dtype != stored else None, st2 if dtype != stored else None,
                           t0, BankPins({"w13": w13, "w2": w2}) if bank and pin == "after" else None)
    if not defer_bank:
        pm.finish()
    return pm
