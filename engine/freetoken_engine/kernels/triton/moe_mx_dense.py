"""Large calls on MXFP4 slots (prefill): each slot the call uses decoded once into a dense scratch,
then the dense kernels.

The 4-bit kernels (moe_mxfp4.py) decode a weight again for every tile of 64 tokens that meets it,
and the decoding, not the memory, bounds them: a 2,048-token call on a layer of gpt-oss-20b (256
pairs an expert) ran at 0.25x of the same call on bf16 slots (H100, bench/mxfp4_gpu.py). Here the
call's slots are decoded once, a few at a time into a scratch of ``MX_SCRATCH_BYTES``, and the
dense kernels run on each few in turn; every pair is computed in exactly one round. The decoded
values are exact in bf16 (and float32), so each product is the 4-bit kernels' own; only the order
of the sums differs (the dense kernels' natural order against the rows' byte order).

No host sync: which slots the call uses is worked out on the device (``used_ranks``), and the
rounds are as many as the call could use (``min(pairs, slots, experts)`` over the scratch's
experts); a round past the slots used decodes nothing and computes nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_mxfp4 import mx_values

#: pairs a slot (on average, over the slots the call can use) from which a large call on MXFP4
#: slots decodes them into the scratch first; None: never (the bench's A/B side)
MX_DENSE_PAIRS: int | None = 64
#: the dense scratch's bytes (at least one expert): gpt-oss's experts are 50 MB in bf16, 10 a round
MX_SCRATCH_BYTES = 512 << 20
_DENSE = (torch.bfloat16, torch.float32)     # the activations' dtypes whose scratch is exact


def scratch_experts(hidden: int, inter: int, itemsize: int) -> int:
    """Experts a round decodes: as many as ``MX_SCRATCH_BYTES`` holds densely, at least one."""
    return max(1, MX_SCRATCH_BYTES // (3 * hidden * inter * itemsize))


def scratch_bytes(hidden: int, inter: int, itemsize: int, experts: int) -> int:
    """The scratch a layer of ``experts`` experts takes at most (the memory budget's share)."""
    return min(experts, scratch_experts(hidden, inter, itemsize)) * 3 * hidden * inter * itemsize


def usable_slots(pairs: int, slots: int, experts: int | None) -> int:
    """The distinct slots a call of ``pairs`` over a pool of ``slots`` can use at most
    (``experts``: a layer's, where the caller knows it)."""
    return min(pairs, slots, experts or slots)


def wants_dense(pairs: int, slots: int, experts: int | None, dtype: torch.dtype) -> bool:
    """Whether a large call decodes its slots first: ``pairs / usable_slots`` (the pairs a slot it
    can use, on average) at least ``MX_DENSE_PAIRS``, activations of a dtype whose scratch holds
    the values exactly."""
    if MX_DENSE_PAIRS is None or dtype not in _DENSE:
        return False
    return pairs >= MX_DENSE_PAIRS * usable_slots(pairs, slots, experts)


def used_ranks(pair_slot: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the device, no sync: ``(pair_rank [P], order [S], count [1])``: each pair's slot's rank
    among the slots the call uses (ascending slot ids; -1 for a pair with no slot), the used slots
    first in ``order`` (rank r is slot ``order[r]``), and how many there are."""
    dev = pair_slot.device
    valid = pair_slot >= 0
    hits = torch.zeros(slots + 1, dtype=torch.int32, device=dev)
    hits.index_add_(0, torch.where(valid, pair_slot, slots).long(), torch.ones_like(pair_slot, dtype=torch.int32))
    used = hits[:slots] > 0
    rank = torch.cumsum(used, 0) - 1
    order = torch.argsort((~used).to(torch.int8), stable=True)
    pair_rank = torch.where(valid, rank.index_select(0, pair_slot.clamp_min(0).long()), -1)
    return pair_rank, order, used.sum().reshape(1)


@triton.jit
def _decode_kernel(src_ptr, dst_ptr, order_ptr, count_ptr, base, R, K, stride_ss, stride_sr, stride_ds,
                   BN: tl.constexpr, BK: tl.constexpr):
    """dst[j] = the values of slot order[base + j]'s R rows of K (MXFP4 rows), for base + j < count:
    a program writes BN rows' BK values [k0, k0 + BK) in their order, contiguously. A run of 16
    values is two 32-bit words (kernels/mxfp4.py): value 2m in word A's nibble m, value 2m + 1 in
    word B's; each word is loaded once, its 8 nibbles shifted out, and the two halves joined value
    by value (``tl.join``: even, odd) into the run's order."""
    j = tl.program_id(0)
    if base + j < tl.load(count_ptr):
        slot = tl.load(order_ptr + base + j).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        run = tl.program_id(2) * (BK // 16) + tl.arange(0, BK // 16)                  # runs of 16 values
        mask = (n < R)[:, None] & (run < K // 16)[None, :]
        rows = src_ptr + slot * stride_ss + n.to(tl.int64)[:, None] * stride_sr
        words = rows.to(tl.pointer_type(tl.int32), bitcast=True) + 2 * run[None, :]
        a = tl.load(words, mask=mask, other=0)[:, :, None]                              # [BN, BK/16, 1]
        b = tl.load(words + 1, mask=mask, other=0)[:, :, None]
        sc = tl.load(rows + K // 2 + (run // 2)[None, :], mask=mask, other=127).to(tl.int32)[:, :, None]
        shift = (4 * tl.arange(0, 8))[None, None, :]
        even = mx_values((a >> shift) & 15, sc)                                         # [BN, BK/16, 8]
        odd = mx_values((b >> shift) & 15, sc)
        v = tl.reshape(tl.join(even, odd), [BN, BK])
        k = tl.program_id(2) * BK + tl.arange(0, BK)
        tl.store(dst_ptr + j * stride_ds + n.to(tl.int64)[:, None] * K + k[None, :], v.to(dst_ptr.dtype.element_ty),
                 mask=(n < R)[:, None] & (k < K)[None, :])


def decode_slots(src: torch.Tensor, order: torch.Tensor, count: torch.Tensor, base: int, dst: torch.Tensor) -> None:
    """``dst[j] = dequantize(src[order[base + j]])`` for each ``j`` with ``base + j < count`` (the
    others left as they are); src uint8 ``[S, R, rb(K)]``, dst ``[C, R, K]`` of a float dtype."""
    c, r, k = dst.shape
    bn, bk = 8, 256
    _decode_kernel[(c, triton.cdiv(r, bn), triton.cdiv(k, bk))](
        src, dst, order, count, base, r, k, src.stride(0), src.stride(1), dst.stride(0), BN=bn, BK=bk, num_warps=4)
