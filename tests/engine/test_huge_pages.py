"""The expert bank sits on transparent huge pages where the kernel grants them.

On 4 KiB pages a load that fills the bank faults 512x as often, each fault holding the process's
page-table lock (a restart's main thread waits on it). Python's ``mmap(-1, n)`` is shared memory,
whose huge pages follow ``shmem_enabled`` ("never" by default), so ``MADV_HUGEPAGE`` on it did
nothing; the bank's mapping is private now (bench/huge_pages.py measures the difference)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken_engine.cache.bank import ExpertBank
from freetoken_engine.packed import memory

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_GRANTED = _THP.exists() and ("[always]" in _THP.read_text() or "[madvise]" in _THP.read_text())
needs_thp = pytest.mark.skipif(not _GRANTED, reason="this kernel grants no transparent huge pages "
                               f"({_THP.read_text().strip() if _THP.exists() else 'no ' + str(_THP)})")


def _bank() -> ExpertBank:
    bank = ExpertBank(2, 8, 1024, 512, torch.bfloat16)      # w13 16 MiB, w2 8 MiB
    bank.w13.fill_(1)
    bank.w2.fill_(1)
    return bank


@needs_thp
def test_the_bank_is_on_huge_pages():
    bank = _bank()
    for t in (bank.w13, bank.w2):
        size = t.numel() * t.element_size()
        # a mapping's unaligned head and tail may stay on small pages: at most 2 x 2 MiB
        assert memory.huge_page_bytes(t) >= size - (4 << 20), "the bank is on 4 KiB pages"


@needs_thp
def test_huge_pages_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("FREETOKEN_HUGE_PAGES", "off")
    bank = _bank()
    assert memory.huge_page_bytes(bank.w13) == 0 and memory.huge_page_bytes(bank.w2) == 0
    assert torch.equal(bank.w13[1, 7], torch.ones_like(bank.w13[1, 7]))

