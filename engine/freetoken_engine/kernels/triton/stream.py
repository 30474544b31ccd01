"""The streamed split's copies: the first rows of some CPU experts, host bank -> GPU scratch.

With whole-expert fills a layer with one or two misses cannot balance PCIe against the CPU (one
fill is all PCIe, none is all CPU). The control step's streamed split (``control.py``,
``StreamSplit``) therefore also hands the GPU the intermediate rows [0, rows) of the first NS
CPU experts: their gate and up rows and the matching first ``rows`` columns of their down
projection are copied into NS scratch slots (never cached), the GPU computes that part of the
expert's sum from them (``moe.py`` with ``limit=``) while the CPU computes rows [rows, I)
(``cpu_experts.experts_forward(rows_from=)``), and the combine adds the two.

``stream_rows_copy`` runs in one launch with no host sync: ``cpu_exp`` and ``rows`` are device
values written by the control step; the loads read the pinned bank over PCIe (as ``gather.py``).
Copied bytes per streamed expert: rows / I of the expert (gate, up and down alike).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_tensor
from .gather import GATHER_TILES, _words, check_bank_copy


@triton.jit
def _stream_kernel(src13_ptr, src2_ptr, dst13_ptr, dst2_ptr, cpu_exp_ptr, rows_ptr, layer, E,
                   ROW_W, I, H, ROW2_W, CHUNKS: tl.constexpr, BLOCK: tl.constexpr, STAGE: tl.constexpr):
    # words: ROW_W per w13 row (H elements), ROW2_W per w2 row (I elements); I rows of each half
    j = tl.program_id(0)
    c = tl.program_id(1)
    e = tl.load(cpu_exp_ptr + j).to(tl.int64)
    rows = tl.load(rows_ptr).to(tl.int64)
    if STAGE:       # split by stage: rows = n, the first n CPU experts' whole w2
        if (e >= 0) & (j < rows):
            off = tl.arange(0, BLOCK)
            per2 = H * ROW2_W
            src2 = src2_ptr + (layer * E + e) * per2
            dst2 = dst2_ptr + j * per2
            for base in range(c * BLOCK, per2, CHUNKS * BLOCK):
                idx = base + off
                msk = idx < per2
                tl.store(dst2 + idx, tl.load(src2 + idx, mask=msk), mask=msk)
    elif (e >= 0) & (rows > 0):
        off = tl.arange(0, BLOCK)
        per13 = 2 * I * ROW_W
        src13 = src13_ptr + (layer * E + e) * per13
        dst13 = dst13_ptr + j * per13
        head = rows * ROW_W                         # gate rows [0, rows), then up rows [I, I + rows)
        for base in range(c * BLOCK, 2 * head, CHUNKS * BLOCK):
            idx = base + off
            msk = idx < 2 * head
            at = tl.where(idx < head, idx, idx - head + I * ROW_W)
            tl.store(dst13 + at, tl.load(src13 + at, mask=msk), mask=msk)
        per2 = H * ROW2_W
        src2 = src2_ptr + (layer * E + e) * per2
        dst2 = dst2_ptr + j * per2
        cols = rows * ROW2_W // I                   # words of the first `rows` columns of a w2 row
        for base in range(c * BLOCK, H * cols, CHUNKS * BLOCK):
            idx = base + off
            msk = idx < H * cols
            h = idx // cols
            at = h * ROW2_W + (idx - h * cols)
            tl.store(dst2 + at, tl.load(src2 + at, mask=msk), mask=msk)


def stream_rows_copy(bank_w13: torch.Tensor, bank_w2: torch.Tensor, scratch13: torch.Tensor,
                     scratch2: torch.Tensor, layer: int, cpu_exp: torch.Tensor, rows: torch.Tensor,
                     stage: bool = False) -> None:
    """Copy rows [0, rows) of experts ``cpu_exp[j]`` (j < NS = len(scratch13); -1: none) of
    ``layer`` into scratch slot j. bank_w13 [L, E, 2I, H] / bank_w2 [L, E, H, I] (pinned host
    memory on a GPU), scratch13 [NS, 2I, H] / scratch2 [NS, H, I] of the same dtype on the
    device, cpu_exp [>= 1] and rows [1] integer device tensors (the control step's). Rows must
    keep a w2 row's head a whole number of 8-byte words (the granule does). ``stage``: the split
    by stage's copy instead: the whole w2 of experts ``cpu_exp[j]``, j < rows[0]. No host sync."""
    dev = scratch13.device
    check_tensor("cpu_exp", cpu_exp, 1, (torch.int32, torch.int64), dev)
    check_tensor("rows", rows, 1, (torch.int32, torch.int64), dev)
    check_bank_copy(bank_w13, bank_w2, scratch13, scratch2, layer)
    experts, two_i, hidden = bank_w13.shape[1:]
    s13, s2 = _words("bank_w13", bank_w13, 2), _words("bank_w2", bank_w2, 2)
    d13, d2 = _words("scratch13", scratch13, 1), _words("scratch2", scratch2, 1)
    row_w = s13.shape[-1] // two_i
    row2_w = s2.shape[-1] // hidden
    n = min(scratch13.shape[0], cpu_exp.numel())
    if n == 0:
        return
    _stream_kernel[(n, GATHER_TILES["chunks"])](
        s13, s2, d13, d2, cpu_exp, rows, layer, experts, row_w, two_i // 2, hidden, row2_w,
        CHUNKS=GATHER_TILES["chunks"], BLOCK=GATHER_TILES["block"], num_warps=GATHER_TILES["warps"], STAGE=stage)
