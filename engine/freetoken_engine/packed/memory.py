"""Host memory for the bank: page-aligned anonymous mappings that can be page-locked in place.

``arena(n)`` is such a mapping (4 KiB-aligned, so O_DIRECT reads land in it directly; private,
with transparent huge pages advised), made without torch so that a read can start before torch is
imported (``early.py``); ``as_tensor(arena, n)`` views it as a uint8 tensor and ``aligned_empty(n)`` does
both. ``map_file_over`` / ``populate`` put a file's pages in place of part of an arena
(``early.py``'s mapped read). ``host_register(t)`` page-locks such a tensor with ``cudaHostRegister`` and undoes it
before the mapping is unmapped, so a later mapping at the same address is never mistaken for
pinned memory (a freed registered buffer would otherwise make CUDA copy stale pages, or fail
with "already registered").
"""
from __future__ import annotations

import ctypes
import mmap
import os
import weakref

from .. import env
from .format import PackedFormatError, align_up

PAGE = 4096


class _Arena(mmap.mmap):
    """An anonymous mapping that can carry a finalizer (a subclass accepts weak references)."""


_ARENAS: "weakref.WeakValueDictionary[int, _Arena]" = weakref.WeakValueDictionary()


def arena(nbytes: int, huge: bool | None = None) -> _Arena:
    """A page-aligned anonymous mapping of at least ``nbytes`` (whole pages), on transparent huge
    pages where the kernel grants them (``huge``: default ``env.huge_pages()``,
    ``FREETOKEN_HUGE_PAGES``; False asks for 4 KiB pages, for A/B runs).

    Private, not shared: ``mmap(-1, n)`` alone is MAP_SHARED, i.e. shmem, whose huge pages follow
    ``shmem_enabled`` ("never" by default), so the advice was ignored and the bank sat on 4 KiB
    pages: a page fault per 4 KiB as a load fills it, each holding the process's page-table lock
    (docs/cpu_kernel.md, "The bank on huge pages")."""
    mm = _Arena(-1, align_up(max(nbytes, 1)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    huge = env.huge_pages() if huge is None else huge
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        try:
            mm.madvise(advice)
        except OSError:
            pass
    return mm


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)     # Linux 5.14
_libc = None
_can_map: bool | None = None


def _lib():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = libc
    return _libc


def address(mm: mmap.mmap) -> int:
    """The first byte's address of a writable mapping (the export is released at once)."""
    c = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(c)
    del c
    return addr


def can_map() -> bool:
    """Whether this system fills a mapping on request (``MADV_POPULATE_READ``, Linux 5.14+)."""
    global _can_map
    if _can_map is None:
        try:
            mm = mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            _can_map = _lib().madvise(address(mm), PAGE, _MADV_POPULATE_READ) == 0
            mm.close()
        except (OSError, AttributeError, ValueError, TypeError):
            _can_map = False
    return _can_map


def map_file_over(mm: mmap.mmap, at: int, nbytes: int, fd: int) -> None:
    """Map the first ``nbytes`` of file ``fd`` over bytes [at, at + nbytes) of the mapping ``mm``
    (page-aligned): private, so a write copies its page and never reaches the file. OSError."""
    where = address(mm) + at
    got = _lib().mmap(where, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_PRIVATE | getattr(mmap, "MAP_FIXED", 0x10), fd, 0)
    if got != where:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def populate(mm: mmap.mmap, at: int, nbytes: int) -> None:
    """Have the kernel fill bytes [at, at + nbytes) of ``mm`` (for a file mapping: read them from
    the disk into the page cache and map them), the GIL released meanwhile. OSError."""
    if _lib().madvise(address(mm) + at, nbytes, _MADV_POPULATE_READ) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def huge_page_bytes(t) -> int:
    """Bytes of the mapping under tensor ``t`` (from ``aligned_empty``) that sit on huge pages now,
    from /proc/self/smaps (AnonHugePages); 0 where that file is missing."""
    start = t.data_ptr()
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= start < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def as_tensor(mm: _Arena, nbytes: int):
    """The first ``nbytes`` of ``mm`` as a uint8 tensor (which keeps the mapping alive)."""
    import torch
    t = torch.frombuffer(mm, dtype=torch.uint8)
    _ARENAS[t.data_ptr()] = mm
    return t[:nbytes]


def aligned_empty(nbytes: int):
    """A page-aligned uint8 tensor of ``nbytes`` (anonymous mmap; it keeps the mapping alive)."""
    return as_tensor(arena(nbytes), nbytes)


def _unregister(ptr: int) -> None:
    try:
        import torch
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the driver may be gone already
        pass


def clear_cuda_error() -> None:
    """Reset CUDA's last error after a failed cudaHostRegister, which PyTorch would otherwise
    report at its next error check. torch's cudart binding lacks cudaGetLastError: use ctypes."""
    import ctypes
    import glob
    import os

    import torch
    roots = [os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(torch.__file__))]
    for root in roots:
        for lib in glob.glob(os.path.join(root, "**", "libcudart.so*"), recursive=True):
            try:
                ctypes.CDLL(lib).cudaGetLastError()
                return
            except OSError:
                continue


def host_register(t, start: int = 0, nbytes: int | None = None):
    """Page-lock ``t`` (a whole ``aligned_empty`` tensor), or its bytes ``[start, start +
    nbytes)`` (page-aligned), in place; False without CUDA, else the ``weakref.finalize`` that
    undoes it (call it to unregister early).

    The registration is undone before the mapping is unmapped (a finalizer on the arena), so a
    later mapping at the same address is never mistaken for pinned memory. Ranges registered one
    by one are separate registrations: a kernel reads across them (unified addressing), but a
    copy whose range spans two fails ("invalid argument"), so ``pinning.BankPins`` keeps one
    registration per bank tensor in the end.
    """
    import torch
    if not torch.cuda.is_available():
        return False
    arena = _ARENAS.get(t.data_ptr())
    if arena is None:
        raise ValueError("only tensors from aligned_empty can be registered here")
    size = t.numel() * t.element_size()
    nbytes = size - start if nbytes is None else nbytes
    if start % PAGE or start < 0 or nbytes <= 0 or start + nbytes > size:
        raise ValueError(f"bytes [{start}, {start + nbytes}) are not a page-aligned range of {size}")
    ptr = t.data_ptr() + start
    rc = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    if rc != 0:
        clear_cuda_error()          # or torch would report it at its next error check
    if rc == 712:  # cudaErrorHostMemoryAlreadyRegistered
        raise PackedFormatError("cudaHostRegister: this address range is already registered; a pinned "
                                "buffer freed earlier in this process was not unregistered")
    if rc != 0:
        raise PackedFormatError(f"cudaHostRegister failed with code {rc}")
    return weakref.finalize(arena, _unregister, ptr)
