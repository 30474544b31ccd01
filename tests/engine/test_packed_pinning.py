"""Page-locking a packed bank while it is read (``packed/pinning.py``): each bank tensor
registered once, whole (its first page early, so graphs can be captured before the read ends),
``w13`` while ``w2`` is still read; a failed registration leaves the bank unpinned and released.
The registrations are faked on a machine without a GPU; the real ones run in the GPU tests."""
from __future__ import annotations

import pytest
import torch
from tiny_models import gate_bank_reads

from freetoken_engine.packed import PackedFormatError, load_packed, preload


@pytest.mark.gpu
def test_preloaded_bank_is_pinned_in_place_and_copies_exactly(tiny_packed):
    """The arenas a preload filled are the bank: pinned after the fill where they lie, and a
    host-to-device copy of them is exact."""
    _, out = tiny_packed
    want = load_packed(out, pin="none").w13.clone()
    preload(out)
    pm = load_packed(out, pin="after")
    assert pm.stats["preloaded"] and pm.pinned
    assert torch.equal(pm.w13.to("cuda", non_blocking=True).cpu(), want)


class _FakeRegistrations:
    """Stands in for cudaHostRegister on a machine without a GPU (the real one runs in the GPU
    tests): records each range, refuses the ``fail_at``-th, and counts the releases."""

    def __init__(self, fail_at: int | None = None):
        self.ranges, self.released, self.fail_at = [], [], fail_at

    def __call__(self, t, start=0, nbytes=None):
        if self.fail_at is not None and len(self.ranges) == self.fail_at:
            raise PackedFormatError("cudaHostRegister failed with code 2")
        self.ranges.append((t.data_ptr(), start, nbytes))
        return lambda: self.released.append((t.data_ptr(), start))


def test_each_bank_tensor_is_registered_once_whole_after_its_head(tiny_packed, monkeypatch):
    """The head page of each tensor first (so the engine can capture its graphs before the read
    ends), released just before the tensor is registered whole: one registration per tensor in
    the end (a copy spanning two registrations fails on the GPU), none overlapping another."""
    from freetoken_engine.packed import pinning
    fake = _FakeRegistrations()
    monkeypatch.setattr(pinning, "host_register", fake)
    _, out = tiny_packed
    pm = load_packed(out, pin="after", defer_bank=True)
    assert pm.pin_head()
    pm.finish()
    assert pm.pinned and pm.stats["pin_seconds"] >= 0
    for t in (pm.w13, pm.w2):
        mine = [(start, n) for ptr, start, n in fake.ranges if ptr == t.data_ptr()]
        assert mine == [(0, 4096), (0, None)]                    # the head, then the whole tensor
    assert fake.released == [(pm.w13.data_ptr(), 0), (pm.w2.data_ptr(), 0)]   # the heads, each once
    order = [ptr for ptr, _, n in fake.ranges if n is None]
    assert order == [pm.w13.data_ptr(), pm.w2.data_ptr()]      # w13 first: it is read first


def test_a_failed_registration_leaves_the_bank_unpinned_and_released(tiny_packed, monkeypatch):
    from freetoken_engine.packed import pinning
    fake = _FakeRegistrations(fail_at=3)
    monkeypatch.setattr(pinning, "host_register", fake)
    _, out = tiny_packed
    want = load_packed(out, pin="none")
    pm = load_packed(out, pin="after", defer_bank=True)
    assert pm.pin_head()
    pm.finish()                                                 # the head of w2 fails to go whole
    assert not pm.pinned and len(fake.released) == 3            # w13's head and whole, w2's head
    assert torch.equal(pm.w13, want.w13) and torch.equal(pm.w2, want.w2)   # the read is unharmed


@pytest.mark.gpu
def test_w13_is_pinned_while_w2_is_still_read(tiny_packed, monkeypatch):
    """A restart pins the bank's larger tensor as soon as its files are in, while the other is
    still read; both end up pinned, and copies of each, whole, are exact."""
    from freetoken_engine.packed import pinning
    _, out = tiny_packed
    want = load_packed(out, pin="none")
    gate = gate_bank_reads(monkeypatch, "bank-w2-")
    calls, register = [], pinning.host_register

    def recorded(t, start=0, nbytes=None):
        calls.append(gate.is_set())
        gate.set()                        # w13 is registered: let the w2 reads go
        return register(t, start, nbytes)
    monkeypatch.setattr(pinning, "host_register", recorded)
    pm = load_packed(out, pin="after")
    assert pm.pinned and calls == [False, True]             # w13 before w2 was read
    assert torch.equal(pm.w13.to("cuda", non_blocking=True).cpu(), want.w13)
    assert torch.equal(pm.w2.to("cuda", non_blocking=True).cpu(), want.w2)
    assert 0 <= pm.stats["pin_after_read_seconds"] < pm.stats["seconds"]


@pytest.mark.gpu
def test_a_bank_whose_head_is_pinned_early_reads_and_copies_exactly(tiny_packed, monkeypatch):
    """The engine pins the bank's first page before the read ends (its decode graphs are captured
    then): the bank counts as pinned at once, and once finished a copy of the whole tensor and
    the fill kernel reading every expert through unified addressing are exact."""
    from freetoken_engine.kernels.triton.gather import gather_fill_rows
    _, out = tiny_packed
    want = load_packed(out, pin="none")
    gate = gate_bank_reads(monkeypatch)
    pm = load_packed(out, pin="after", defer_bank=True)
    assert pm.pin_head() and pm.w13.is_pinned() and pm.w2.is_pinned()
    gate.set()
    pm.finish()
    assert pm.pinned
    assert torch.equal(pm.w13.to("cuda", non_blocking=True).cpu(), want.w13)
    L, E = pm.w13.shape[:2]
    slots13 = torch.empty((L * E, *pm.w13.shape[2:]), dtype=pm.w13.dtype, device="cuda")
    slots2 = torch.empty((L * E, *pm.w2.shape[2:]), dtype=pm.w2.dtype, device="cuda")
    for layer in range(L):
        experts = torch.arange(E, device="cuda")
        gather_fill_rows(pm.w13, pm.w2, slots13, slots2, layer, experts, experts + layer * E)
    assert torch.equal(slots13.cpu(), want.w13.reshape(L * E, *pm.w13.shape[2:]))
    assert torch.equal(slots2.cpu(), want.w2.reshape(L * E, *pm.w2.shape[2:]))

