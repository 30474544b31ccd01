"""Device half of a flag handshake with a host thread through pinned memory (graph-capturable).

A decode step is numbered by ``epoch`` ([1] int64 on the device): ``bump(epoch)`` starts a step
(first node of its graph), ``signal(word, epoch)`` publishes to the host that everything earlier
in the stream is visible (a system-scope fence, then ``word = epoch``), and ``wait(word, epoch,
err)`` holds the stream until the host stores ``word >= epoch``. The host side is
``kernels/cpu/branch.cpp``; the protocol is described in ``kernels/cpu_branch.py``.

``wait`` never hangs the device: after ``max_spins`` polls (each a read over PCIe, about a
microsecond; the default is several seconds) it gives up, stores the epoch into ``err`` and lets
the stream go on. The caller checks ``err`` at its next sync and discards that step.

Under ``TRITON_INTERPRET=1`` (CPU tests) the kernels run in the launching thread, so the host
side must run in another thread; the fence is then a no-op (the host is the only memory system).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_contiguous, check_tensor, interpreting

DEFAULT_MAX_SPINS = 1 << 23


@triton.jit
def _bump_kernel(epoch_ptr):
    tl.store(epoch_ptr, tl.load(epoch_ptr) + 1)


@triton.jit
def _signal_kernel(word_ptr, epoch_ptr, FENCE: tl.constexpr):
    e = tl.load(epoch_ptr)
    if FENCE:
        # fence.sc.sys: this stream's earlier writes (the previous kernels' host mirrors) become
        # visible to the host before the word does.
        e = tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b64 $0, $1;", "=l,l", [e],
                                      dtype=tl.int64, is_pure=False, pack=1)
    tl.store(word_ptr, e)


@triton.jit
def _wait_kernel(word_ptr, epoch_ptr, err_ptr, max_spins):
    e = tl.load(epoch_ptr)
    v = tl.load(word_ptr, volatile=True)
    n = 0
    while (v < e) & (n < max_spins):
        v = tl.load(word_ptr, volatile=True)
        n += 1
    if v < e:
        tl.store(err_ptr, e)


def _check_word(name: str, t: torch.Tensor) -> None:
    check_tensor(name, t, 1, (torch.int64,))
    check_contiguous(name, t)
    if t.numel() != 1:
        raise ValueError(f"{name} must be one int64 element (a view like flags[l:l+1]), got {t.numel()}")


def bump(epoch: torch.Tensor) -> None:
    """``epoch += 1`` on the device (the first node of a step)."""
    _check_word("epoch", epoch)
    _bump_kernel[(1,)](epoch, num_warps=1)


def signal(word: torch.Tensor, epoch: torch.Tensor) -> None:
    """``word = epoch`` after a system-scope fence. ``word``: one int64 of pinned host memory
    (or any memory the host thread reads), e.g. ``flags[l:l+1]``."""
    _check_word("word", word)
    _check_word("epoch", epoch)
    _signal_kernel[(1,)](word, epoch, FENCE=epoch.device.type == "cuda" and not interpreting(), num_warps=1)


def wait(word: torch.Tensor, epoch: torch.Tensor, err: torch.Tensor, max_spins: int = DEFAULT_MAX_SPINS) -> None:
    """Hold the stream until ``word >= epoch`` (stored by the host), at most ``max_spins`` polls;
    on a timeout ``err = epoch`` and the stream continues."""
    for name, t in (("word", word), ("epoch", epoch), ("err", err)):
        _check_word(name, t)
    if max_spins < 1:
        raise ValueError(f"max_spins must be >= 1, got {max_spins}")
    _wait_kernel[(1,)](word, epoch, err, max_spins, num_warps=1)
