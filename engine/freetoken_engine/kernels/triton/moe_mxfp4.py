"""MXFP4 slots in the Triton MoE kernels (moe.py's ``MX`` constexpr): rows decoded where they are
loaded, 16 code bytes (one block of 32 values and its one scale) at a time.

A row (kernels/mxfp4.py) is K/2 code bytes, K/32 scales, zero padding to 16 bytes, so each row
starts 16-byte aligned and a thread loads a block's codes with one 16-byte load. The kernels do
not put the values back in their order: byte b's low nibble holds value ``v(b, 0)`` and its high
nibble ``v(b, 1)`` (``value_order``), and the activations that meet them are read in that order
instead. The tokens' rows are gathered once a call (``byte_order``: x[:, order]); the gate/up
kernels write the intermediate rows in the down rows' byte order (``inter_pos``), so the down
kernels read both halves contiguously. Each product is the one the dense kernels form on the
same values (the decoded values are exact in bf16); only the order of the sum differs.

A code becomes a value without a table or a select: its sign, exponent and mantissa bits are
placed where a float16 keeps them (``mx_halves``; exponent 0 lands on float16's subnormals, which
the conversion to float32 keeps), which gives the value times 2^-14; the kernels that keep float32
values multiply by 2^14 and the block's scale (``mx_rows``), and the one-token kernels scale each
block's sum of products once instead (``mx_rows_f16``, ``mx_block_sums``; building each value
first ran 1.4x slower there, stop 60).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..mxfp4 import value_order

_ORDERS: dict = {}


def byte_order(k: int, device: torch.device) -> torch.Tensor:
    """Indices ``[k]`` (int64, on ``device``) that put a row of k values in MXFP4 byte order:
    the first k/2 the values of each code byte's low nibble, the next k/2 its high nibble's."""
    key = (k, str(device))
    if key not in _ORDERS:
        _ORDERS[key] = value_order(k, device)          # made there: no copy (a graph may be capturing)
    return _ORDERS[key]


@triton.jit
def mx_scale(sc):
    """Scale bytes (int32) as float32 factors 2^(sc - 127), exact (byte 0: the subnormal 2^-127)."""
    return tl.where(sc == 0, 5.877471754111438e-39, (sc << 23).to(tl.float32, bitcast=True))


@triton.jit
def _f16_bits(bits):
    """int32 values holding float16 bit patterns, as float32 (the conversion keeps subnormals)."""
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def mx_halves(b):
    """Both e2m1 codes of code bytes ``b`` (int32, 0..255) times 2^-14, in float32, exact: each
    code's bits placed where a float16's sign, exponent and mantissa take them (a code of exponent
    0 lands on float16's subnormals, which the conversion keeps), so no select and no table.
    Returns (low nibbles, high)."""
    return (_f16_bits(((b & 8) << 12) | ((b & 7) << 9)),
            _f16_bits(((b & 0x80) << 8) | ((b & 0x70) << 5)))


@triton.jit
def mx_values(codes, sc):
    """e2m1 codes (int32, 0..15) times 2^(sc - 127) (int32 scale bytes, broadcast) in float32,
    exact: ``mx_halves``' float16 placement, times 2^14 (exact), times the scale."""
    v, _ = mx_halves(codes)
    return v * 16384.0 * mx_scale(sc)


@triton.jit
def mx_rows_f16(rows, k0, K, rmask, G: tl.constexpr):
    """Code bytes [k0, k0 + 16 G) of the MXFP4 rows at pointers ``rows`` ([BN]; k0 a multiple of
    16) decoded without their scales: (low nibbles, high nibbles) [BN, G, 16] float32 (block, byte
    within it) in byte order, the codes' values times 2^-14 (``mx_halves``), zero past the row's
    codes and in the rows ``rmask`` leaves out; and the blocks' scales [BN, G] (2^(sc - 127))."""
    g = k0 // 16 + tl.arange(0, G)                                        # blocks of 32 values
    gmask = rmask[:, None] & (g[None, :] < K // 32)                       # [BN, G]
    codes = tl.load(rows[:, None, None] + (g * 16)[None, :, None] + tl.arange(0, 16)[None, None, :],
                    mask=gmask[:, :, None], other=0).to(tl.int32)
    sc = tl.load(rows[:, None] + K // 2 + g[None, :], mask=gmask, other=127).to(tl.int32)
    lo, hi = mx_halves(codes)
    return lo, hi, mx_scale(sc)


@triton.jit
def mx_rows(rows, k0, K, rmask, G: tl.constexpr):
    """``mx_rows_f16``'s halves as the values themselves (times 2^14, exact, and their blocks'
    scales): (low, high) [BN, G, 16] float32."""
    lo, hi, scale = mx_rows_f16(rows, k0, K, rmask, G)
    scale = scale[:, :, None]
    return lo * 16384.0 * scale, hi * 16384.0 * scale


@triton.jit
def mx_block_sums(wl, wh, al, ah, scale):
    """A block's products summed, then scaled: ``mx_rows_f16``'s halves against activations in
    byte order ([1 or BN, G, 16]), times 2^14 (exact) and the blocks' ``scale``: [BN, G]."""
    return tl.sum(wl * al + wh * ah, 2) * 16384.0 * scale


@triton.jit
def mx_acts(ptr, k0, K, G: tl.constexpr):
    """A row of activations in byte order at ``ptr`` (K values), as mx_rows' halves meet them:
    (low, high), each [1, G, 16] float32, zero past the row."""
    kb = k0 + tl.arange(0, G)[:, None] * 16 + tl.arange(0, 16)[None, :]     # [G, 16] code bytes
    lo = tl.load(ptr + kb, mask=kb < K // 2, other=0.0).to(tl.float32)
    hi = tl.load(ptr + K // 2 + kb, mask=kb < K // 2, other=0.0).to(tl.float32)
    return lo[None, :, :], hi[None, :, :]


@triton.jit
def mx_row_acts(rows, valid, k0, K, BKB: tl.constexpr):
    """Code bytes [k0, k0 + BKB) of activation rows of K values in byte order at pointers ``rows``
    ([BM]; ``valid``: the rows that exist), as mx_dot takes them: (low, high), each [BM, BKB]."""
    kb = k0 + tl.arange(0, BKB)
    m = valid[:, None] & (kb < K // 2)[None, :]
    return (tl.load(rows[:, None] + kb[None, :], mask=m, other=0.0),
            tl.load(rows[:, None] + K // 2 + kb[None, :], mask=m, other=0.0))


@triton.jit
def dot_acc(a, w, acc, UPCAST: tl.constexpr):
    """acc + a @ w, the tiled MoE kernels' step: in float32 (ieee) when UPCAST, else on the tensor
    cores in w's dtype."""
    if UPCAST:
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(a.to(w.dtype), w, acc)
    return acc


@triton.jit
def mx_dot(al, ah, wl, wh, acc, UPCAST: tl.constexpr):
    """acc + al @ wl^T + ah @ wh^T: activations [BM, BKB] in byte order against mx_rows' halves
    ([BN, BKB / 16, 16]), the decoded weights taken in the activations' dtype (exact)."""
    wl = tl.trans(tl.reshape(wl, [wl.shape[0], wl.shape[1] * 16])).to(al.dtype)
    wh = tl.trans(tl.reshape(wh, [wh.shape[0], wh.shape[1] * 16])).to(ah.dtype)
    return dot_acc(ah, wh, dot_acc(al, wl, acc, UPCAST), UPCAST)


@triton.jit
def inter_pos(n, I):
    """Where intermediate value n goes in a row of I values in the down rows' byte order (the
    inverse of ``value_order``): value 16R + 4i + 2h + j is nibble h of byte 8R + 4j + i."""
    u = n % 16
    return ((u // 2) % 2) * (I // 2) + (n // 16) * 8 + (u % 2) * 4 + u // 4
