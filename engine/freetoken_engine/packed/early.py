"""Reading a packed folder's files into page-aligned arenas, startable before torch is imported.

A restart of a large model is the disk read of its bank plus the engine's start: ``import torch``
alone takes 3-4 s on the H200 host. ``preload(folder)`` (``freetoken_engine.preload``; the CLI
calls it for a packed ``--model`` before anything imports torch) checks the index structurally,
allocates the arenas and returns at once while background threads read; ``load_packed`` then
adopts that read (waiting for what is left of it) when its options match, and otherwise cancels
it and reads again. A failed read raises from ``load_packed``, naming the file and block.

``Fill``: spans of ``SPAN`` 16 MiB blocks handed out to ``threads`` threads in turn, each read
with one ``os.preadv`` (GIL released) through an O_DIRECT descriptor when the filesystem takes
one and the span is aligned, straight into its final place, each block's CRC32 checked as it
lands when ``check``. A reader needs the GIL between two reads, which the imports and the graph
capture running beside it hold for long stretches: a span of several blocks takes it that many
times less often. Nothing in this module imports torch.

A mapped read (``mapped``: a restart, no CRC pass, of an engine whose bank is not pinned for a
GPU; ``FREETOKEN_MAP_BANK``): each bank piece file is mapped privately over its place in the
arena (``MAP_FIXED``; a write would copy its page, never reach the file) and the workers ask
the kernel to fill it (``MADV_POPULATE_READ``, Linux 5.14+): the disk's DMA lands in page-cache
pages that become the bank's pages, with nothing zeroed and nothing copied. On the 2-CPU VM that read 2.7-2.8 GB/s with 0.2 s of CPU, against
1.4-2.0 GB/s and 2-4 s of CPU for O_DIRECT into fresh memory (``bench/read_cpu_cost.py``).
"""
from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
import zlib
from pathlib import Path
from typing import Callable

from ..cachefile import read_json, write_json
from . import early_cuda
from .format import ALIGN, INDEX_NAME, PackedFormatError, bank_layers, bank_piece_bytes, read_index
from .memory import PAGE, arena, can_map, map_file_over, populate


SPAN = 4          # blocks per read (64 MiB at the format's 16 MiB blocks)


def maps_bank(device: str | None, verified: bool) -> bool:
    """Whether a read for an engine on ``device`` maps the bank: a restart (the folder
    ``verified`` before) of an engine that does not pin it for a GPU, where the system can."""
    from .. import env
    return (verified and env.map_bank() and device is not None and not device.startswith("cuda")
            and can_map())


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


def already_verified(folder: Path, index: dict) -> bool:
    """True when every file is as it was at a load that checked every block's CRC."""
    try:
        return read_json(_stamp_path(folder)) == _file_stamps(folder, index)
    except OSError:
        return False


def record_verified(folder: Path, index: dict) -> None:
    try:
        write_json(_stamp_path(folder), _file_stamps(folder, index))
    except OSError:
        pass  # a read-only cache only costs a re-check next time


class Fill:
    """Every file of a packed folder read into arenas: ``arenas[name]`` for a dense file (the
    whole file), ``arenas["w13"]`` / ``arenas["w2"]`` for the bank in the stored dtype and final
    layout (each piece file at its layers' offset; padding past a piece is read for the CRC only).
    The arenas exist from construction; ``start`` launches the reads (the dense files' blocks
    first), ``wait_dense`` waits for the dense files, ``wait`` for everything."""

    def __init__(self, folder: Path, index: dict, check: bool, direct: bool, threads: int,
                 progress: Callable[[float], None] | None = None, span: int | None = None,
                 mapped: bool = False):
        span = SPAN if span is None else span
        if threads < 1 or span < 1:
            raise ValueError(f"threads and span must be >= 1, got {threads}, {span}")
        self.folder, self.index, self.check, self.direct, self.threads = folder, index, check, direct, threads
        self.progress = progress
        self.block = index["block_bytes"]
        self.arenas: dict = {}
        dests = {}                      # file -> (arena, offset of its first byte, bytes kept)
        for name, meta in index["files"].items():
            if name.startswith("dense-"):
                self.arenas[name] = arena(meta["size"])
                dests[name] = (self.arenas[name], 0, meta["size"])
        bank = index.get("bank")
        if bank:
            layers = bank_layers(bank)
            per = {t: bank_piece_bytes(index, t, (0, 1)) for t in ("w13", "w2")}
            for t in ("w13", "w2"):
                self.arenas[t] = arena(per[t] * layers)
            # w13 (two thirds of the bank) first: it is pinned while w2 is still read (pinning.py)
            for p in sorted(bank["pieces"], key=lambda p: (p["tensor"] != "w13", p["layers"][0])):
                a, b = p["layers"]
                dests[p["file"]] = (self.arenas[p["tensor"]], a * per[p["tensor"]], (b - a) * per[p["tensor"]])
        # bank pieces mapped instead of read (module docstring): whole pages only, no CRC pass
        maps = mapped and not check and can_map()
        self.mapped = {name: dest for name, dest in dests.items() if maps and not name.startswith("dense-")
                       and dest[1] % PAGE == 0 and dest[2] % PAGE == 0}
        # (file, first block, blocks, arena, offset, bytes kept): spans of whole blocks that are
        # all kept; a block the kept bytes end inside (a piece's padded tail) is a job of its own
        self.jobs = []
        for name, dest in dests.items():
            blocks = (index["files"][name]["size"] + self.block - 1) // self.block
            whole = min(blocks, dest[2] // self.block)
            self.jobs += [(name, b, min(span, whole - b), *dest) for b in range(0, whole, span)]
            self.jobs += [(name, b, 1, *dest) for b in range(whole, blocks)]
        self.total = sum(index["files"][name]["size"] for name in dests)
        # reads still to do per file, and an event set once a file is all in (or the read ended);
        # dense files first in the queue: a deferred-bank load (load_packed) waits for them only
        self._reads_left = {name: 0 for name in dests}
        for job in self.jobs:
            self._reads_left[job[0]] += 1
        self._file_done = {name: threading.Event() for name in dests}
        for name, n in self._reads_left.items():
            if not n:
                self._file_done[name].set()
        self.done_bytes = self.direct_bytes = self.mapped_bytes = 0
        self.error: PackedFormatError | None = None
        self.cancelled = False
        self._next = 0
        self._lock = threading.Lock()
        self._last = -1.0
        self._workers: list[threading.Thread] = []
        self.started = self.finished = 0.0
        self.fds: dict[str, tuple[int, int | None]] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Fill":
        for name in {j[0] for j in self.jobs}:
            path = str(self.folder / name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                self.close()
                raise PackedFormatError(f"{path}: cannot open ({exc})") from None
            dfd = None
            if name in self.mapped:
                self._map(name, fd)
            elif self.direct and hasattr(os, "O_DIRECT"):
                try:
                    dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                except OSError:
                    dfd = None          # e.g. tmpfs: no O_DIRECT, the page cache it is
            self.fds[name] = (fd, dfd)
        self.started = time.perf_counter()
        self._workers = [threading.Thread(target=self._work, name=f"ft-fill-{i}", daemon=True)
                         for i in range(min(self.threads, max(1, len(self.jobs))))]
        for w in self._workers:
            w.start()
        return self

    def _map(self, name: str, fd: int) -> None:
        """Map file ``name``'s kept bytes over their place in the arena (``memory.map_file_over``)."""
        mm, base, keep = self.mapped[name]
        try:
            map_file_over(mm, base, keep, fd)
        except OSError as exc:
            self.close()
            raise PackedFormatError(f"{self.folder / name}: cannot map ({exc.strerror})") from None

    def cancel(self) -> None:
        """Stop handing out blocks (those being read finish), and release the files."""
        self.cancelled = True
        self._wake_all()
        for w in self._workers:
            w.join()
        self.close()

    def wait(self) -> float:
        """Join the reads; -> seconds from start to the last block. Raises the first failure."""
        for w in self._workers:
            w.join()
        self.close()
        if self.error is not None:
            raise self.error
        if self.cancelled:
            raise PackedFormatError(f"{self.folder}: the read was cancelled")
        return self.finished - self.started

    def wait_dense(self) -> None:
        """Wait until every dense file is in (the bank may still be reading). Raises the first
        failure so far."""
        for name, done in self._file_done.items():
            if name.startswith("dense-"):
                done.wait()
        if self.error is not None:
            self.wait()                 # join the workers, release the files, raise

    def wait_file(self, name: str) -> None:
        """Wait until every block of file ``name`` is in (the rest may still be reading, which is
        when a caller pins what has landed). Raises the read's first failure, or
        PackedFormatError once the read was cancelled."""
        self._file_done[name].wait()
        if self.error is not None or self.cancelled:
            self.wait()                 # join the workers, release the files, raise

    def _wake_all(self) -> None:
        for event in self._file_done.values():
            event.set()

    def close(self) -> None:
        for fd, dfd in self.fds.values():
            os.close(fd)
            if dfd is not None:
                os.close(dfd)
        self.fds = {}

    # -- the reads ---------------------------------------------------------------------------
    def _work(self) -> None:
        while not self.cancelled and self.error is None:
            with self._lock:
                k, self._next = self._next, self._next + 1
            if k >= len(self.jobs):
                break
            try:
                self._read(*self.jobs[k])
            except PackedFormatError as exc:
                with self._lock:
                    self.error = self.error or exc
                self._wake_all()
        with self._lock:
            self.finished = max(self.finished, time.perf_counter())

    def _pread(self, fd: int, dest: memoryview, off: int) -> None:
        got = 0
        while got < len(dest):
            n = os.preadv(fd, [dest[got:]], off + got)
            if n <= 0:
                raise PackedFormatError(f"short read at offset {off + got}")
            got += n

    def _read(self, name: str, b: int, count: int, mm, base: int, keep: int) -> None:
        meta = self.index["files"][name]
        fd, dfd = self.fds[name]
        off = b * self.block
        n = min(count * self.block, meta["size"] - off)
        inside = max(0, min(n, keep - off))
        use_direct = False
        try:
            if name in self.mapped:     # the kernel fills the mapping (the padded tail is not kept)
                if inside:
                    populate(mm, base + off, inside)
            elif inside == n:
                mv = memoryview(mm)[base + off:base + off + n]
                # arenas are page-aligned, so the address is aligned when base + off is
                use_direct = dfd is not None and (base + off) % ALIGN == 0 and n % ALIGN == 0
                try:
                    self._pread(dfd if use_direct else fd, mv, off)
                except OSError:
                    if not use_direct:
                        raise
                    use_direct = False
                    self._pread(fd, mv, off)
            else:                       # the padded tail past what is kept: bounce it
                mv = memoryview(bytearray(n))
                self._pread(fd, mv, off)
                if inside:
                    memoryview(mm)[base + off:base + off + inside] = mv[:inside]
        except OSError as exc:
            raise PackedFormatError(f"{self.folder / name}: read failed at block {b} ({exc})") from None
        for k in range(count if self.check else 0):
            at, end = k * self.block, min(n, (k + 1) * self.block)
            if zlib.crc32(mv[at:end]) != meta["crc32"][b + k]:
                raise PackedFormatError(f"{self.folder / name}: block {b + k} (bytes {off + at}..{off + end}) "
                                        f"fails its CRC32 check: the file is corrupt; re-run freetoken convert")
        with self._lock:
            self.done_bytes += n
            self.direct_bytes += n if use_direct else 0
            self.mapped_bytes += inside if name in self.mapped else 0
            self._reads_left[name] -= 1
            if not self._reads_left[name]:
                self._file_done[name].set()
            frac = self.done_bytes / max(1, self.total)
            if self.progress and (frac - self._last >= 0.01 or frac >= 1.0):
                self._last = frac
                self.progress(frac)


_pending: dict[str, Fill] = {}
_pending_lock = threading.Lock()


SMALL_FILES_BYTES = 64 << 20


def read_small_files(folder: Path, index: dict, limit: int = SMALL_FILES_BYTES) -> list[str]:
    """Read the folder's files other than the packed data (config, generation config, tokenizer)
    into the page cache, largest last, up to ``limit`` bytes in all; -> their names. The start
    reads them after the bank's reads have queued on the disk, where each read waited behind that
    queue (config.json 0.2 s on the H200 host, device run 78)."""
    packed = set(index["files"]) | {INDEX_NAME}
    sizes = []
    for p in folder.iterdir():
        try:
            st = p.stat()
        except OSError:
            continue                    # gone, or a dangling link: the start says so if it needs it
        if p.name not in packed and stat.S_ISREG(st.st_mode):
            sizes.append((st.st_size, p.name, p))
    done = []
    for size, _, p in sorted(sizes):
        if size > limit:
            break
        try:
            with open(p, "rb") as f:
                while f.read(1 << 20):
                    pass
        except OSError:
            continue
        limit -= size
        done.append(p.name)
    return done


def preload(folder: str | Path, threads: int = 8, device: str | None = None, mapped_only: bool = False) -> bool:
    """Start reading the packed folder ``folder`` in the background; returns at once. The next
    ``load_packed`` of the same folder (``LLM``, ``freetoken serve``) takes the read over. Call
    it before importing torch so that the read overlaps the imports. ``device``: the engine's
    device; a CUDA one gets its context made meanwhile too (``early_cuda``). The folder's small
    files are read first (``read_small_files``). ``mapped_only``: start only a read that maps the
    bank (``maps_bank``), which costs the imports no CPU. Returns whether a read started. Raises
    PackedFormatError for a folder whose index or files fail the structural checks."""
    folder = Path(folder)
    index = read_index(folder)
    verified = already_verified(folder, index)
    mapped = maps_bank(device, verified)
    if mapped_only and not mapped:
        return False
    read_small_files(folder, index)
    fill = Fill(folder, index, not verified, True, threads, mapped=mapped).start()
    early_cuda.start(device)
    with _pending_lock:
        old = _pending.pop(_key(folder), None)
        _pending[_key(folder)] = fill
    if old is not None:
        old.cancel()
    return True


def _key(folder: str | Path) -> str:
    return str(Path(folder).resolve())


def take(folder: str | Path) -> Fill | None:
    """The preloaded read of ``folder``, now the caller's; None if there is none."""
    with _pending_lock:
        return _pending.pop(_key(folder), None)


def discard(folder: str | Path) -> None:
    """Cancel and drop the preloaded read of ``folder``, if any (an engine that failed to start:
    the read's memory is released instead of held by a process that will never load it)."""
    fill = take(folder)
    if fill is not None:
        fill.cancel()
