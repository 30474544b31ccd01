"""A step's fills copied from the host bank into their victim slots: one launch, no host sync.

``gather_fill_rows`` copies, for every i with ``fill_exp[i] >= 0``, the bank rows
``bank_w13[layer, fill_exp[i]]`` and ``bank_w2[layer, fill_exp[i]]`` into
``w13_slots[fill_slot[i]]`` and ``w2_slots[fill_slot[i]]``. The fill list lives on the device
(written by the control step), so the host never learns the addresses: on a GPU the kernel's
loads read the pinned bank directly over PCIe (pinned memory is mapped into the device's
address space under unified addressing). Rows are moved as 8-byte words, the chunks of every
row are spread over the grid so that many reads are in flight at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_contiguous, check_tensor

_WORD = torch.int64
#: grid chunks per fill and words per chunk iteration; module-level so that a benchmark can set
#: the fastest for the GPU and link at hand (bench/offload_bandwidth.py ``tune_gather``).
GATHER_TILES = {"chunks": 16, "block": 2048, "warps": 8}


@triton.jit
def _gather_kernel(src13_ptr, src2_ptr, dst13_ptr, dst2_ptr, fill_exp_ptr, fill_slot_ptr,
                   layer, E, ROW13, ROW2, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    e = tl.load(fill_exp_ptr + i).to(tl.int64)
    if e >= 0:
        v = tl.load(fill_slot_ptr + i).to(tl.int64)
        src_row = layer * E + e
        off = tl.arange(0, BLOCK)
        # Chunk c of each row: a BLOCK-strided share, so every program moves about the same bytes.
        for base in range(c * BLOCK, ROW13, CHUNKS * BLOCK):
            idx = base + off
            msk = idx < ROW13
            w = tl.load(src13_ptr + src_row * ROW13 + idx, mask=msk)
            tl.store(dst13_ptr + v * ROW13 + idx, w, mask=msk)
        for base in range(c * BLOCK, ROW2, CHUNKS * BLOCK):
            idx = base + off
            msk = idx < ROW2
            w = tl.load(src2_ptr + src_row * ROW2 + idx, mask=msk)
            tl.store(dst2_ptr + v * ROW2 + idx, w, mask=msk)


def _words(name: str, t: torch.Tensor, lead: int) -> torch.Tensor:
    """``t`` as rows of 8-byte words after its first ``lead`` dims (a view, no copy)."""
    check_contiguous(name, t)
    row_bytes = t[(0,) * lead].numel() * t.element_size() if t.numel() else 0
    if row_bytes % 8:
        raise ValueError(f"{name} rows must be a multiple of 8 bytes, got {row_bytes}")
    return t.view(-1).view(_WORD).view(*t.shape[:lead], row_bytes // 8)


def check_bank_copy(bank_w13: torch.Tensor, bank_w2: torch.Tensor, dst13: torch.Tensor, dst2: torch.Tensor,
                    layer: int) -> None:
    """Raise ValueError unless rows of ``layer`` of the bank (``[L, E, 2I, H]`` / ``[L, E, H, I]``,
    pinned host memory on a GPU) can be copied into the device pools ``dst13 [S, 2I, H]`` /
    ``dst2 [S, H, I]`` (one dtype, as many slots in both). For this module and ``stream.py``."""
    dev = dst13.device
    if bank_w13.dim() != 4 or bank_w2.dim() != 4 or dst13.dim() != 3 or dst2.dim() != 3:
        raise ValueError("bank tensors are [L, E, ...] and slot pools [S, ...]")
    if bank_w13.shape[2:] != dst13.shape[1:] or bank_w2.shape[2:] != dst2.shape[1:] \
            or dst13.shape[0] != dst2.shape[0]:
        raise ValueError(f"row shapes differ: bank {tuple(bank_w13.shape)} / {tuple(bank_w2.shape)}, "
                         f"slots {tuple(dst13.shape)} / {tuple(dst2.shape)}")
    if len({bank_w13.dtype, bank_w2.dtype, dst13.dtype, dst2.dtype}) != 1:
        raise ValueError("bank and slot pools must share one dtype")
    n_layers = bank_w13.shape[0]
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} out of range [0, {n_layers})")
    if dev.type == "cuda" and not (bank_w13.device == dev or bank_w13.is_pinned()):
        raise ValueError("on a GPU the bank must be pinned host memory (or on the device)")


def gather_fill_rows(bank_w13: torch.Tensor, bank_w2: torch.Tensor, w13_slots: torch.Tensor,
                     w2_slots: torch.Tensor, layer: int, fill_exp: torch.Tensor, fill_slot: torch.Tensor,
                     chunks: int | None = None, block: int | None = None) -> None:
    """Copy the listed fills (see the module docstring). bank_w13 [L, E, 2I, H] and bank_w2
    [L, E, H, I] (pinned host memory on a GPU), slots [S, 2I, H] / [S, H, I] of the same dtype,
    fill_exp / fill_slot [NF] int on the slots' device. ``chunks`` / ``block`` default to
    ``GATHER_TILES``. Raises ValueError on a mismatch."""
    dev = w13_slots.device
    check_tensor("fill_exp", fill_exp, 1, (torch.int32, torch.int64), dev)
    check_tensor("fill_slot", fill_slot, 1, (torch.int32, torch.int64), dev)
    check_bank_copy(bank_w13, bank_w2, w13_slots, w2_slots, layer)
    if fill_exp.numel() != fill_slot.numel():
        raise ValueError("fill_exp and fill_slot differ in length")
    experts = bank_w13.shape[1]
    if fill_exp.numel() == 0:
        return
    s13, s2 = _words("bank_w13", bank_w13, 2), _words("bank_w2", bank_w2, 2)
    d13, d2 = _words("w13_slots", w13_slots, 1), _words("w2_slots", w2_slots, 1)
    chunks = GATHER_TILES["chunks"] if chunks is None else chunks
    block = GATHER_TILES["block"] if block is None else block
    _gather_kernel[(fill_exp.numel(), chunks)](
        s13, s2, d13, d2, fill_exp, fill_slot, layer, experts, s13.shape[-1], s2.shape[-1],
        CHUNKS=chunks, BLOCK=block, num_warps=GATHER_TILES["warps"])
