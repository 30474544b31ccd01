"""Device half of a flag handshake with a host thread through pinned memory (graph-capturable).

A decode step is numbered by ``epoch`` ([1] int64 on the device): ``bump(epoch)`` starts a step
(first node of its graph), ``signal(word, epoch)`` publishes to the host that everything earlier
in the stream is visible (a system-scope fence, then ``word = epoch``), and ``wait(word, epoch,
err)`` holds the stream until the host stores ``word >= epoch``. The host side is
``kernels/cpu/branch.cpp``; the protocol is described in ``kernels/cpu_branch.py``.

``wait`` never hangs the device: after ``timeout_s`` of the GPU's clock (default 120 s; polls
under the interpreter) it gives up, stores the epoch into ``err`` and lets the stream go on. The
caller checks ``err`` at its next sync and fails that step.

Under ``TRITON_INTERPRET=1`` (CPU tests) the kernels run in the launching thread, so the host
side must run in another thread; the fence is then a no-op (the host is the only memory system).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_contiguous, check_tensor, interpreting

DEFAULT_MAX_SPINS = 1 << 23
# The host loop may not start at once: its thread needs the GIL for a moment, and a Triton
# compile in the launching thread can hold it for seconds (measured: a poll-count limit of
# ~1 s tripped on the H200 on a decode step that compiled new kernel variants).
DEFAULT_TIMEOUT_S = 120.0


@triton.jit
def _bump_kernel(epoch_ptr):
    tl.store(epoch_ptr, tl.load(epoch_ptr) + 1)


@triton.jit
def _signal_kernel(word_ptr, epoch_ptr, src_ptr, dst_ptr, N, FENCE: tl.constexpr, COPY: tl.constexpr,
                   BLOCK: tl.constexpr):
    if COPY:        # publish src into host memory with this program's own stores (ordered by the fence)
        for start in range(0, N, BLOCK):
            off = start + tl.arange(0, BLOCK)
            m = off < N
            tl.store(dst_ptr + off, tl.load(src_ptr + off, mask=m), mask=m)
        tl.debug_barrier()
    e = tl.load(epoch_ptr)
    if FENCE:
        # fence.sc.sys: this stream's earlier writes (the previous kernels' host mirrors) become
        # visible to the host before the word does.
        e = tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b64 $0, $1;", "=l,l", [e],
                                      dtype=tl.int64, is_pure=False, pack=1)
    tl.store(word_ptr, e)


@triton.jit
def _now_ns(dep):
    # the GPU's global nanosecond timer (``dep`` only gives the asm an operand)
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [dep], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _wait_kernel(word_ptr, epoch_ptr, err_ptr, limit, TIMER: tl.constexpr):
    e = tl.load(epoch_ptr)
    v = tl.load(word_ptr, volatile=True)
    if TIMER:       # limit: nanoseconds of the device's clock
        t0 = _now_ns(e)
        while (v < e) & (_now_ns(v) - t0 < limit):
            v = tl.load(word_ptr, volatile=True)
    else:           # limit: polls (the interpreter has no device clock)
        n = 0
        while (v < e) & (n < limit):
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


def signal(word: torch.Tensor, epoch: torch.Tensor, src: torch.Tensor | None = None,
           dst: torch.Tensor | None = None) -> None:
    """``word = epoch`` after a system-scope fence. ``word``: one int64 of pinned host memory
    (or any memory the host thread reads), e.g. ``flags[l:l+1]``. With ``src`` / ``dst``
    (contiguous, same dtype and size; ``dst`` pinned host memory): first copy ``src`` into
    ``dst`` with the same kernel's stores, so the fence orders them before the word. (A
    ``dst.copy_(src)`` runs on a copy engine, whose writes the fence does not order.)"""
    _check_word("word", word)
    _check_word("epoch", epoch)
    copy = src is not None
    if copy:
        if dst is None or not (src.is_contiguous() and dst.is_contiguous()) or src.dtype != dst.dtype \
                or src.numel() != dst.numel():
            raise ValueError("src and dst must be contiguous tensors of one dtype and size")
    _signal_kernel[(1,)](word, epoch, src if copy else word, dst if copy else word, src.numel() if copy else 0,
                         FENCE=epoch.device.type == "cuda" and not interpreting(), COPY=copy, BLOCK=1024,
                         num_warps=4 if copy else 1)


def wait(word: torch.Tensor, epoch: torch.Tensor, err: torch.Tensor, timeout_s: float = DEFAULT_TIMEOUT_S,
         max_spins: int = DEFAULT_MAX_SPINS) -> None:
    """Hold the stream until ``word >= epoch`` (stored by the host): on a GPU at most
    ``timeout_s`` seconds of its clock, under the interpreter at most ``max_spins`` polls; on a
    timeout ``err = epoch`` and the stream continues."""
    for name, t in (("word", word), ("epoch", epoch), ("err", err)):
        _check_word(name, t)
    if max_spins < 1 or not timeout_s > 0:
        raise ValueError(f"need max_spins >= 1 and timeout_s > 0, got {max_spins}, {timeout_s}")
    timer = epoch.device.type == "cuda" and not interpreting()
    _wait_kernel[(1,)](word, epoch, err, int(timeout_s * 1e9) if timer else max_spins, TIMER=timer, num_warps=1)
