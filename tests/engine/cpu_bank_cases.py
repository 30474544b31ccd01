"""A bank of 3.1 MB experts behind OffloadedExperts, and the CPU kernel held to two workers: for
the tests of q* by the CPU's measured rate (test_cpu_contention.py, test_model_rate.py)."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch


def bank_experts():
    """OffloadedExperts over a bank of 4 layers x 16 random bf16 experts of 3.1 MB (torch backend)."""
    from freetoken_engine.cache.bank import ExpertBank
    from freetoken_engine.cache.experts import ExpertCache
    from freetoken_engine.cache.offload import OffloadedExperts
    bank = ExpertBank(4, 16, 1024, 512, torch.bfloat16)          # 3.1 MB experts
    g = torch.Generator().manual_seed(0)
    bank.w13.copy_(torch.randn(bank.w13.shape, generator=g))
    bank.w2.copy_(torch.randn(bank.w2.shape, generator=g))
    return OffloadedExperts(bank, ExpertCache(bank, 64, "cpu", fill_fraction=1.0), 6, backend="torch", top_k=4)


@contextlib.contextmanager
def two_kernel_workers():
    """The compiled CPU kernel held to two workers (skips without it or without 2 CPUs)."""
    from freetoken_engine.kernels import cpu_experts as ce
    if not ce.available() or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs the compiled kernel and 2 CPUs")
    cfg = ce.configure()
    ce.configure(threads=2)
    try:
        yield
    finally:
        ce.configure(threads=cfg.threads, isa=cfg.isa, prefetch_bytes=cfg.prefetch_bytes, spin_us=cfg.spin_us)
