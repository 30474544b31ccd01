"""Routed expert pairs over the expert cache's slot pool: fused gate/up + SwiGLU, then down.

Contract (the same as ``kernels.reference.expert_pairs_forward`` with ``pair_exp`` = slot ids):

    out[p] = W2[s] @ (silu(W1[s] @ x[t]) * (W3[s] @ x[t]))     t = pair_tok[p], s = pair_slot[p]

with ``w13_slots[s] = cat(W1[s], W3[s])`` (``[2I, H]``) and ``w2_slots[s]`` (``[H, I]``). Pairs with
``pair_slot[p] < 0`` (computed on the CPU) get a zero row, so the caller can select per pair.
Weights are bf16 (or any float dtype), products accumulate in float32, the intermediate
activation is rounded to ``x.dtype`` (where the reference rounds it too) and the output is in
``x.dtype``. Routing weights are applied by the caller. A (token, slot) pair must not repeat
(top-k routing never repeats an expert for a token): pairs sharing a slot are then at most T.

Grouping: the pairs of one slot are computed as one tile, so an expert's weights are read once
per call. For small calls (decode, P <= 64) each program finds its slot's pairs itself (no
preprocessing, nothing to launch but the two kernels: good for CUDA graphs). For large calls
(prefill) a block table is built with a few device-side torch ops (no host sync).

One token (a batch-1 decode call, P <= 64) takes two other kernels (``lanes``, moe_lanes.py):
each pair is its own expert, so a program owns a few weight rows of one pair (``LANES_TILES``: 2
gate and 2 up rows, 8 down rows) and multiplies elementwise in fp32, reducing once at the end, as
``gemv.py``'s one-token kernel does. A Qwen3-30B expert is then 640 programs instead of the tiled
kernels' 56: a call of one to four experts (a layer's fills, or its hits in a small cache) runs
1.3-1.8x faster on the H200, a call of eight 0.97-1.06x (``bench/moe_decode_kernel.py``); the whole
engine's decode did not move beyond its noise (docs/gpu.md). Every one-token call takes them, so
a pair's row does not depend on which call computed it.

Slots of MXFP4 rows (uint8 ``[S, 2I, rb(H)]`` / ``[S, H, rb(I)]``, rb: kernels/mxfp4.py's
row_bytes; the ``MX`` constexpr) are decoded where they are loaded, a block of 32 values a 16-byte
load, and meet the activations in the rows' byte order (moe_mxfp4.py); their values are exact in bf16.
A large call whose slots meet many pairs each (a prefill's whole layer) decodes them once into a
dense scratch instead, a few slots a round, and runs the dense kernels (moe_mx_dense.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..mxfp4 import row_bytes
from ..reference import SILU, GatedAct
from ._common import check_tensor, interpreting, next_pow2
from .moe_lanes import down_lanes_kernel, gate_up_lanes_kernel, gated
from .moe_mx_dense import decode_slots, scratch_experts, usable_slots, used_ranks, wants_dense
from .moe_mxfp4 import byte_order, dot_acc, inter_pos, mx_dot, mx_row_acts, mx_rows

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_INDEX = (torch.int32, torch.int64)
SMALL_P = 64          # calls with at most this many pairs group inside the kernel
_ACTS = {"silu": 0, "swiglu_oai": 1}     # the gate kernels' ACT
#: tile sizes (BN, BK of gate/up; BN, BK of down; warps) for small calls and for large ones;
#: module-level so that a benchmark or a tuning run can set them for the GPU at hand.
DECODE_TILES = {"bn1": 32, "bk1": 128, "bn2": 64, "bk2": 128, "warps": 4}
PREFILL_TILES = {"bn1": 64, "bk1": 64, "bn2": 128, "bk2": 64, "warps": 8}
#: one token (a batch-1 decode call): the lanes kernels' tiles (BN rows of one pair's expert a
#: program, K streamed in BK blocks), or None for the tiled kernels above (the bench's A/B side).
#: The best of 36 in bench/moe_decode_kernel.py --sweep on the H200 (2026-12-04), 1 and 8 experts
#: a call, both Qwen shapes: 1.5-1.8x the tiled kernels with one expert, 0.97-1.06x with 8.
LANES_TILES: dict | None = {"bn1": 2, "bk1": 2048, "bn2": 8, "bk2": 256, "warps": 4}
#: the same for MXFP4 slots (bench/mxfp4_gpu.py --sweep, gpt-oss-20b's shape, 4 experts a call,
#: H100, in a CUDA graph of 32 calls; each block's sum scaled once, moe_mxfp4.mx_block_sums):
#: 62.3-62.5 us a call (bf16 86.8-88.8; the other 9 tile sets 60-74; with each value built and
#: scaled first, these tiles took 86.4-86.9 and the others 86-122; two runs, 2026-12-05, stop 60).
#: The tiled kernels keep the values: a batched product a block there ran 2.3-3.6x slower.
LANES_TILES_MX: dict | None = {"bn1": 4, "bk1": 1024, "bn2": 8, "bk2": 512, "warps": 4}


@triton.jit
def _rows_of_program(pid, pair_slot_ptr, block_rows_ptr, block_slot_ptr, P,
                     BLOCK_P: tl.constexpr, BM: tl.constexpr, IN_KERNEL: tl.constexpr):
    """The slot and the pair rows (``[BM]``, -1 padded) this program computes; slot < 0: none."""
    r = tl.arange(0, BM)
    if IN_KERNEL:
        # Program pid owns pair pid's slot iff pid is the first pair with that slot.
        q = tl.arange(0, BLOCK_P)
        slots = tl.load(pair_slot_ptr + q, mask=q < P, other=-1).to(tl.int64)
        s = tl.load(pair_slot_ptr + pid).to(tl.int64)
        match = (slots == s) & (q < P)
        dup = tl.sum((match & (q < pid)).to(tl.int32), 0)
        s = tl.where(dup > 0, -1, s)
        rank = tl.cumsum(match.to(tl.int32), 0) - 1
        sel = (rank[None, :] == r[:, None]) & match[None, :]               # [BM, BLOCK_P]
        rows = tl.sum(tl.where(sel, q[None, :] + 1, 0), 1) - 1           # -1 where no pair
    else:
        s = tl.load(block_slot_ptr + pid).to(tl.int64)
        rows = tl.load(block_rows_ptr + pid * BM + r).to(tl.int64)
    return s, rows


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, inter_ptr, pair_tok_ptr, pair_slot_ptr, block_rows_ptr,
                    block_slot_ptr, limit_ptr, b13_ptr, pair_bias_ptr, alpha, clamp,
                    P, H, I, stride_xt, stride_ws, stride_wn, stride_b,
                    BLOCK_P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    IN_KERNEL: tl.constexpr, UPCAST: tl.constexpr, LIMIT: tl.constexpr,
                    ACT: tl.constexpr, BIAS: tl.constexpr, MX: tl.constexpr):
    pid = tl.program_id(0)
    s, rows = _rows_of_program(pid, pair_slot_ptr, block_rows_ptr, block_slot_ptr, P,
                               BLOCK_P, BM, IN_KERNEL)
    lim = I
    if LIMIT:       # only intermediate rows [0, limit) (a streamed part of an expert)
        lim = tl.minimum(tl.load(limit_ptr).to(tl.int32), I)
    if (s >= 0) & (tl.program_id(1) * BN < lim):
        valid = rows >= 0
        toks = tl.load(pair_tok_ptr + rows, mask=valid, other=0).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < lim
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        w_base = w13_ptr + s * stride_ws
        if MX:          # x in byte order (moe_mxfp4.py), BK / 2 code bytes a step
            gate = w_base + n.to(tl.int64) * stride_wn
            for k0 in range(0, H // 2, BK // 2):
                xl, xh = mx_row_acts(x_ptr + toks * stride_xt, valid, k0, H, BK // 2)
                gl, gh = mx_rows(gate, k0, H, nmask, BK // 32)
                ul, uh = mx_rows(gate + I * stride_wn, k0, H, nmask, BK // 32)
                acc_g = mx_dot(xl, xh, gl, gh, acc_g, UPCAST)
                acc_u = mx_dot(xl, xh, ul, uh, acc_u, UPCAST)
        else:
            for k0 in range(0, H, BK):
                k = k0 + tl.arange(0, BK)
                kmask = k < H
                xt = tl.load(x_ptr + toks[:, None] * stride_xt + k[None, :],
                             mask=valid[:, None] & kmask[None, :], other=0.0)           # [BM, BK]
                wmask = kmask[:, None] & nmask[None, :]
                wg = tl.load(w_base + n[None, :] * stride_wn + k[:, None], mask=wmask, other=0.0)        # [BK, BN]
                wu = tl.load(w_base + (n[None, :] + I) * stride_wn + k[:, None], mask=wmask, other=0.0)  # [BK, BN]
                acc_g = dot_acc(xt, wg, acc_g, UPCAST)
                acc_u = dot_acc(xt, wu, acc_u, UPCAST)
        if BIAS:          # each pair's expert's gate/up biases (its row of b13)
            b = b13_ptr + tl.load(pair_bias_ptr + rows, mask=valid, other=0).to(tl.int64)[:, None] * stride_b
            bmask = valid[:, None] & nmask[None, :]
            acc_g += tl.load(b + n[None, :], mask=bmask, other=0.0).to(tl.float32)
            acc_u += tl.load(b + I + n[None, :], mask=bmask, other=0.0).to(tl.float32)
        h = gated(acc_g, acc_u, alpha, clamp, ACT)                          # float32
        col = inter_pos(n, I) if MX else n                  # MX: in the down rows' byte order
        tl.store(inter_ptr + rows[:, None] * I + col[None, :], h.to(inter_ptr.dtype.element_ty),
                 mask=valid[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(inter_ptr, w2_ptr, out_ptr, pair_slot_ptr, block_rows_ptr, block_slot_ptr, limit_ptr,
                 P, H, I, stride_ws, stride_wn, stride_ot,
                 BLOCK_P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 IN_KERNEL: tl.constexpr, UPCAST: tl.constexpr, LIMIT: tl.constexpr, MX: tl.constexpr):
    pid = tl.program_id(0)
    s, rows = _rows_of_program(pid, pair_slot_ptr, block_rows_ptr, block_slot_ptr, P,
                               BLOCK_P, BM, IN_KERNEL)
    lim = I
    if LIMIT:
        lim = tl.minimum(tl.load(limit_ptr).to(tl.int32), I)
    if s >= 0:
        valid = rows >= 0
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < H
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        w_base = w2_ptr + s * stride_ws
        if MX:          # the intermediate rows in byte order (the gate/up kernel wrote them so)
            for k0 in range(0, I // 2, BK // 2):
                al, ah = mx_row_acts(inter_ptr + rows * I, valid, k0, I, BK // 2)
                wl, wh = mx_rows(w_base + n.to(tl.int64) * stride_wn, k0, I, nmask, BK // 32)
                acc = mx_dot(al, ah, wl, wh, acc, UPCAST)
        else:
            for k0 in range(0, lim, BK):
                k = k0 + tl.arange(0, BK)
                kmask = k < lim
                a = tl.load(inter_ptr + rows[:, None] * I + k[None, :],
                            mask=valid[:, None] & kmask[None, :], other=0.0)            # [BM, BK]
                w = tl.load(w_base + n[None, :] * stride_wn + k[:, None], mask=kmask[:, None] & nmask[None, :],
                            other=0.0)
                acc = dot_acc(a, w, acc, UPCAST)
        tl.store(out_ptr + rows[:, None] * stride_ot + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & nmask[None, :])


def block_table(pair_slot: torch.Tensor, block_m: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group pairs by slot into tiles of ``block_m`` rows, on the device, without a host sync.

    Returns ``block_rows [NB, block_m]`` (pair indices, -1 padded) and ``block_slot [NB]`` (-1 for
    unused blocks), with NB = ceil(P / block_m) + min(P, slots + 1), an upper bound on the blocks
    needed (each distinct slot, and the CPU pairs' group, adds at most one partial block).
    """
    p = pair_slot.numel()
    dev = pair_slot.device
    nb = triton.cdiv(p, block_m) + min(p, slots + 1)
    big = torch.iinfo(torch.int64).max
    key = torch.where(pair_slot >= 0, pair_slot.long(), big)
    sorted_slot, order = torch.sort(key, stable=True)
    idx = torch.arange(p, device=dev)
    is_start = torch.ones(p, dtype=torch.bool, device=dev)
    is_start[1:] = sorted_slot[1:] != sorted_slot[:-1]
    group_start = torch.cummax(torch.where(is_start, idx, 0), 0).values
    pos = idx - group_start                                        # position inside its slot group
    block_of = torch.cumsum((pos % block_m == 0).long(), 0) - 1
    block_rows = torch.full((nb * block_m,), -1, dtype=torch.int64, device=dev)
    block_rows[block_of * block_m + pos % block_m] = order
    block_slot = torch.full((nb,), -1, dtype=torch.int64, device=dev)
    block_slot[block_of] = torch.where(sorted_slot == big, -1, sorted_slot)
    return block_rows.view(nb, block_m), block_slot


def moe_slots_forward(x: torch.Tensor, w13_slots: torch.Tensor, w2_slots: torch.Tensor,
                      pair_tok: torch.Tensor, pair_slot: torch.Tensor,
                      out: torch.Tensor | None = None, limit: torch.Tensor | None = None,
                      zero: bool = True, act: GatedAct = SILU, b13: torch.Tensor | None = None,
                      pair_bias: torch.Tensor | None = None, experts: int | None = None) -> torch.Tensor:
    """Compute every (token, slot) pair from the slot pool; see the module docstring.
    ``zero=False``: the rows of pairs with a negative slot are left unset instead of zeroed (one
    launch less, for callers that select per pair, as the engine's combine does).
    ``limit`` ([1] int on the device): only the intermediate rows [0, limit) of every slot, the
    GPU's part of a streamed split (``stream.py``); the slots' other rows are not read.

    x [T, H]; w13_slots [S, 2I, H]; w2_slots [S, H, I]; pair_tok, pair_slot [P] int32/int64 on
    x's device. Returns ``out [P, H]`` in x.dtype (written into ``out`` when given). Raises
    ValueError on a shape, dtype, device or stride the kernels cannot take. No host sync.

    ``act``, ``b13 [E, 2I]`` (contiguous rows), ``pair_bias [P]``: experts of another kind, as
    ``reference.expert_pairs_forward`` takes them (gpt-oss); the biases are added to the float32
    gate/up sums, the activation computed in float32 (one rounding, as the plain gate's).
    ``experts``: how many distinct slots the call can use at most (a layer's experts), which
    tells a large call on MXFP4 slots how many pairs a slot meets (``moe_mx_dense.wants_dense``)
    and how many rounds it takes; default ``S``.
    """
    dev = x.device
    mx = w13_slots.dtype == torch.uint8            # MXFP4 rows (kernels/mxfp4.py)
    check_tensor("x", x, 2, _FLOATS)
    check_tensor("w13_slots", w13_slots, 3, (torch.uint8,) if mx else _FLOATS, dev)
    check_tensor("w2_slots", w2_slots, 3, (torch.uint8,) if mx else _FLOATS, dev)
    check_tensor("pair_tok", pair_tok, 1, _INDEX, dev)
    check_tensor("pair_slot", pair_slot, 1, _INDEX, dev)
    t, h = x.shape
    s, two_i, h13 = w13_slots.shape
    inter = two_i // 2
    row13, row2 = (row_bytes(h), row_bytes(inter)) if mx and h % 32 == 0 and inter % 32 == 0 else (h, inter)
    if h13 != row13 or two_i % 2 or tuple(w2_slots.shape) != (s, h, row2) or (mx and row13 == h):
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, w13_slots {tuple(w13_slots.shape)}, "
                         f"w2_slots {tuple(w2_slots.shape)}")
    if mx and limit is not None:
        raise ValueError("a streamed part of an expert (limit) takes dense slots, not MXFP4 rows")
    if w13_slots.stride(1) != row13 or w2_slots.stride(1) != row2:
        raise ValueError("slot rows must be dense: w13_slots.stride(1) == H and w2_slots.stride(1) == I")
    if x.stride(1) != 1:
        raise ValueError("x needs a unit stride in its last dim")
    if limit is not None:
        check_tensor("limit", limit, 1, _INDEX, dev)
    if act.kind not in _ACTS:
        raise ValueError(f"expert activation {act.kind!r}: one of {', '.join(_ACTS)}")
    if b13 is not None:
        check_tensor("b13", b13, 2, _FLOATS, dev)
        pair_bias = pair_slot if pair_bias is None else pair_bias
        check_tensor("pair_bias", pair_bias, 1, _INDEX, dev)
        if b13.shape[1] != two_i or b13.stride(1) != 1 or pair_bias.numel() != pair_slot.numel():
            raise ValueError(f"b13 must be [experts, {two_i}] with unit-stride rows and pair_bias a row per pair, "
                             f"got {tuple(b13.shape)} and {pair_bias.numel()} of {pair_slot.numel()} pairs")
    gate = dict(b13_ptr=b13 if b13 is not None else x, pair_bias_ptr=pair_bias if b13 is not None else pair_slot,
                alpha=act.alpha, clamp=act.limit, stride_b=b13.stride(0) if b13 is not None else 0,
                ACT=_ACTS[act.kind], BIAS=b13 is not None, MX=mx)
    p = pair_tok.numel()
    if pair_slot.numel() != p:
        raise ValueError(f"pair_tok has {p} pairs, pair_slot {pair_slot.numel()}")
    if out is None:
        out = (torch.zeros if zero else torch.empty)((p, h), dtype=x.dtype, device=dev)
    else:
        check_tensor("out", out, 2, (x.dtype,), dev)
        if tuple(out.shape) != (p, h):
            raise ValueError(f"out must be [{p}, {h}], got {tuple(out.shape)}")
        if zero:
            out.zero_()
    if p == 0:
        return out
    upcast = interpreting() or x.dtype == torch.float32 or w13_slots.dtype == torch.float32
    inter_buf = torch.empty((p, inter), dtype=torch.float32 if upcast else x.dtype, device=dev)
    lim = limit if limit is not None else pair_slot
    if mx and p > SMALL_P and limit is None and wants_dense(p, s, experts, x.dtype):
        _dense_rounds(x, w13_slots, w2_slots, inter_buf, out, pair_tok, pair_slot, experts, upcast, gate)
        return out
    if mx:              # the tokens' rows in the MXFP4 rows' byte order (moe_mxfp4.py)
        x = x.index_select(1, byte_order(h, dev))
    lanes = LANES_TILES_MX if mx else LANES_TILES
    if t == 1 and p <= SMALL_P and lanes is not None:
        bn1, bk1, bn2, bk2, warps = (lanes[key] for key in ("bn1", "bk1", "bn2", "bk2", "warps"))
        gate_up_lanes_kernel[(p, triton.cdiv(inter, bn1))](
            x, w13_slots, inter_buf, pair_slot, lim, H=h, I=inter, stride_ws=w13_slots.stride(0),
            stride_wn=w13_slots.stride(1), BN=bn1, BK=min(bk1, next_pow2(h)), LIMIT=limit is not None,
            num_warps=warps, **gate)
        down_lanes_kernel[(p, triton.cdiv(h, bn2))](
            inter_buf, w2_slots, out, pair_slot, lim, h, inter, w2_slots.stride(0), w2_slots.stride(1),
            out.stride(0), BN=bn2, BK=min(bk2, next_pow2(inter)), LIMIT=limit is not None, MX=mx, num_warps=warps)
        return out
    in_kernel = p <= SMALL_P
    if in_kernel:
        bm = max(16, next_pow2(min(p, t)))
        rows, slots = pair_slot, pair_slot          # rows/slots tables unused
    else:
        bm = 64
        rows, slots = block_table(pair_slot, bm, s)
    _tiled(x, w13_slots, w2_slots, inter_buf, out, pair_tok, pair_slot, lim, rows, slots, bm, upcast,
           limit is not None, gate)
    return out


def _tiled(x, w13, w2, inter_buf, out, pair_tok, pair_slot, lim, rows, slots, bm, upcast, limited, gate) -> None:
    """The tiled kernels' two launches: grouped in the kernel where ``rows`` is ``pair_slot``
    (a small call), else over the block table ``rows [NB, bm]`` / ``slots [NB]``; ``limited``:
    only the intermediate rows below ``lim[0]`` (a streamed part)."""
    p, h, inter = pair_tok.numel(), out.shape[1], inter_buf.shape[1]
    in_kernel = rows is pair_slot
    nb = p if in_kernel else slots.numel()
    tiles = DECODE_TILES if in_kernel else PREFILL_TILES
    bn1, bk1, bn2, bk2, warps = (tiles[key] for key in ("bn1", "bk1", "bn2", "bk2", "warps"))
    block_p = next_pow2(p) if in_kernel else 1
    _gate_up_kernel[(nb, triton.cdiv(inter, bn1))](
        x, w13, inter_buf, pair_tok, pair_slot, rows, slots, lim,
        P=p, H=h, I=inter, stride_xt=x.stride(0), stride_ws=w13.stride(0), stride_wn=w13.stride(1),
        BLOCK_P=block_p, BM=bm, BN=bn1, BK=bk1, IN_KERNEL=in_kernel, UPCAST=upcast, LIMIT=limited,
        num_warps=warps, **gate)
    _down_kernel[(nb, triton.cdiv(h, bn2))](
        inter_buf, w2, out, pair_slot, rows, slots, lim,
        p, h, inter, w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_P=block_p, BM=bm, BN=bn2, BK=bk2, IN_KERNEL=in_kernel, UPCAST=upcast, LIMIT=limited,
        MX=gate["MX"], num_warps=warps)


def _dense_rounds(x, w13, w2, inter_buf, out, pair_tok, pair_slot, experts, upcast, gate) -> None:
    """A large call on MXFP4 slots in rounds (moe_mx_dense.py): the slots it uses ranked on the
    device, the pairs grouped by rank once, then each round decodes the next few used slots into
    the dense scratch and runs the dense kernels on the blocks of those ranks."""
    p, h, s, inter = pair_tok.numel(), x.shape[1], w13.shape[0], inter_buf.shape[1]
    rank, order, count = used_ranks(pair_slot, s)
    used = usable_slots(p, s, experts)
    bm = 64
    rows, block_rank = block_table(rank, bm, used)  # ranks < used: the blocks' bound follows them
    c = min(used, scratch_experts(h, inter, x.element_size()))
    d13 = torch.empty((c, 2 * inter, h), dtype=x.dtype, device=x.device)
    d2 = torch.empty((c, h, inter), dtype=x.dtype, device=x.device)
    dense = dict(gate, MX=False)
    for base in range(0, used, c):
        decode_slots(w13, order, count, base, d13)
        decode_slots(w2, order, count, base, d2)
        here = (block_rank >= base) & (block_rank < base + c)
        _tiled(x, d13, d2, inter_buf, out, pair_tok, pair_slot, pair_slot, rows,
               torch.where(here, block_rank - base, -1), bm, upcast, False, dense)
