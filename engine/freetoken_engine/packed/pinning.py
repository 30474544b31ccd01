"""Page-locking a packed bank while it is being read.

Registering a 60 GB bank after its read costs seconds on top of the read (``cudaHostRegister``
walks every page), and registering it before the read slows the read (the registration faults
every page in, on one thread). ``BankPins`` registers each of the bank's two tensors (``w13``,
two thirds of the bytes, then ``w2``) whole, as soon as all of its files are in: ``w13``'s
registration runs while ``w2`` is still read. One registration per tensor, because a copy
(``cudaMemcpyAsync``) whose range spans two registrations fails with "invalid argument" (H200,
device run 52), so a bank registered piece by piece could not be copied in one piece.

``head()`` registers the first page of each tensor before anything is read. Kernel launchers
(Triton's) refuse a host pointer that CUDA does not know, so without it no step that takes the
bank as an argument could be launched, or captured in a CUDA graph, before the read ends; the
engine captures its decode graphs then, with every expert resident, so that no launch reads a
byte of the bank (``DeviceControl.all_resident``). The head is released just before its tensor
is registered whole (the graphs keep working: under unified addressing the device sees the
registered bank at its host address either way).
"""
from __future__ import annotations

import time

from .format import PackedFormatError
from .memory import PAGE, host_register


class BankPins:
    """Registrations of the bank tensors ``tensors`` (name -> the whole ``aligned_empty``-backed
    tensor: "w13", "w2"): first page early (``head``), then each tensor whole."""

    def __init__(self, tensors: dict):
        self.tensors = tensors
        self.heads: dict = {}                # name -> finalizer of its first page's registration
        self.whole: dict = {}                # name -> finalizer of its whole registration
        self.failed = False
        self.busy = 0.0                      # seconds spent registering

    def _register(self, name: str, nbytes: int | None):
        if self.failed:
            return None
        t0 = time.perf_counter()
        try:
            fin = host_register(self.tensors[name], 0, nbytes)
        except PackedFormatError:
            self.release()
            return None
        finally:
            self.busy += time.perf_counter() - t0
        if not fin:                          # no CUDA: nothing to pin
            self.failed = True
            return None
        return fin

    def head(self) -> bool:
        """Register the first page of every tensor (see the module docstring)."""
        for name, t in self.tensors.items():
            if name in self.heads or name in self.whole:
                continue
            if t.numel() * t.element_size() < PAGE or not (fin := self._register(name, PAGE)):
                return False
            self.heads[name] = fin
        return True

    def register(self, name: str) -> bool:
        """Register tensor ``name`` whole (its head released first); False after a failure."""
        if name in self.whole:
            return True
        head = self.heads.pop(name, None)
        if head is not None:
            head()
        fin = self._register(name, None)
        if fin is None:
            return False
        self.whole[name] = fin
        return True

    def as_read(self, fill, index: dict) -> None:
        """Register each tensor whole as soon as all of its files are in, while the rest is
        read. Raises the read's failure (``PackedFormatError``), after releasing everything."""
        for name in self.tensors:
            for piece in index["bank"]["pieces"]:
                if piece["tensor"] == name:
                    try:
                        fill.wait_file(piece["file"])
                    except PackedFormatError:
                        self.release()
                        raise
            if not self.register(name):
                return

    def rest(self) -> bool:
        """Register whatever is not registered yet (after the read)."""
        return all(self.register(name) for name in self.tensors)

    def release(self) -> None:
        """Undo every registration (a failure: the bank is left unpinned)."""
        for fin in [*self.heads.values(), *self.whole.values()]:
            fin()
        self.heads, self.whole = {}, {}
        self.failed = True
