"""A Gated DeltaNet layer's decode step (one token per sequence) in two launches; torch's ops take
about fifty a layer (``layers/deltanet.py``: ``GatedDeltaNet._singles`` and ``_gated_norm``, the
reference these kernels are tested against).

``conv_step``: one program per (sequence, block of channels): the causal depthwise convolution
of the token's projected q, k and v after the last ``conv - 1`` inputs kept in the sequence's
state slot, then SiLU; the slot's inputs shift by one in place (each channel by one program).

``recurrent_step``: one program per (sequence, value head): q and k of its key head
l2-normalised (q scaled by k_dim^-1/2), beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias),
then per block of the head's value dimensions the state's decay, delta correction and read
(the float32 state [k_dim, v_dim] updated in place in its slot), and last the head's output
RMS-normed, scaled and gated by SiLU(z). Rounding points as the reference: the convolution's and
SiLU's outputs, beta, the head's output and its normed value rounded to the data type.
Tolerance (tests/engine/test_triton_deltanet.py): fp32 1e-5 relative; 16-bit a few roundings.

Kimi Delta Attention (``recurrent_step(kda=True)``, ``layers/kda.py``): the same step with a decay
per key channel, ``-exp(A_log) softplus(f + dt_bias)`` from the forget gate's output f (one value
per head and channel, given where Gated DeltaNet's a is), and the output's norm in float32 times
sigmoid(gate) rounded once, as ``KimiDeltaAttention._gated_norm``.

Chained rows (``chain=``): a draft's verification on a GPU runs as decode rows, several of one
sequence (``executor/inputs.as_decode_rows``). Its tokens are sequential in a recurrent layer, so
the program of a chain's first row runs the chain's rows one after the other, each from the state
the previous one wrote (a block barrier between), and writes every row's state into its own slot:
the snapshots a rejected draft token rolls back to. Programs of the chain's other rows do nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2


@triton.jit
def _next_row(r, B, cont_ptr, CHAIN: tl.constexpr):
    """The row after ``r`` when it continues r's chain (a draft's next token), else -1."""
    nxt = r * 0 - 1
    if CHAIN:
        more = tl.load(cont_ptr + r + 1, mask=r + 1 < B, other=0)
        nxt = tl.where(more != 0, r + 1, -1)
    return nxt


@triton.jit
def _conv_kernel(x_ptr, x_stride, state_ptr, src_ptr, dst_ptr, cont_ptr, B, w_ptr, y_ptr, C, K: tl.constexpr,
                 BLOCK: tl.constexpr, CHAIN: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < C
    first = True
    if CHAIN:
        first = tl.load(cont_ptr + b) == 0          # a chain's later rows run in its first row's program
    if first:
        src = tl.load(src_ptr + b).to(tl.int64)
        r = b
        while r >= 0:
            dst = tl.load(dst_ptr + r).to(tl.int64)
            src_base = state_ptr + src * (K - 1) * C
            dst_base = state_ptr + dst * (K - 1) * C
            x = tl.load(x_ptr + r * x_stride + cols, mask=m, other=0.0)
            acc = tl.load(w_ptr + cols * K + (K - 1), mask=m, other=0.0).to(tl.float32) * x.to(tl.float32)
            prev = tl.load(src_base + cols, mask=m, other=0.0)             # the oldest input kept
            for j in tl.static_range(K - 1):
                acc += tl.load(w_ptr + cols * K + j, mask=m, other=0.0).to(tl.float32) * prev.to(tl.float32)
                if j + 1 < K - 1:
                    nxt = tl.load(src_base + (j + 1) * C + cols, mask=m, other=0.0)
                    tl.store(dst_base + j * C + cols, nxt, mask=m)          # the kept inputs shift by one
                    prev = nxt
            tl.store(dst_base + (K - 2) * C + cols, x, mask=m)
            conv = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            tl.store(y_ptr + r * C + cols, (conv / (1.0 + tl.exp(-conv))).to(y_ptr.dtype.element_ty), mask=m)
            tl.debug_barrier()                     # the next row reads what this one wrote
            src = dst
            r = _next_row(r, B, cont_ptr, CHAIN)


@triton.jit
def _recurrent_kernel(y_ptr, zab_ptr, zab_stride, state_ptr, src_ptr, dst_ptr, cont_ptr, B, neg_a_ptr, dt_ptr,
                      w_ptr, out_ptr, eps, KH, R, VH, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                      CHAIN: tl.constexpr, KDA: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    kh = hv // R
    C = 2 * KH * DK + VH * DV
    kd = tl.arange(0, DK)
    first = True
    if CHAIN:
        first = tl.load(cont_ptr + b) == 0
    if first:
        src = tl.load(src_ptr + b).to(tl.int64)
        r = b
        while r >= 0:
            dst = tl.load(dst_ptr + r).to(tl.int64)
            row = y_ptr + r * C
            q = tl.load(row + kh * DK + kd).to(tl.float32)
            k = tl.load(row + KH * DK + kh * DK + kd).to(tl.float32)
            q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) / tl.sqrt(DK * 1.0)
            k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
            zab = zab_ptr + r * zab_stride                              # z [VH * DV], b [VH], a [VH]
            bb = tl.load(zab + VH * DV + hv).to(tl.float32)
            beta = (1.0 / (1.0 + tl.exp(-bb))).to(zab_ptr.dtype.element_ty).to(tl.float32)
            if KDA:     # a decay per key channel: [DK]
                a = (tl.load(zab + VH * DV + VH + hv * DK + kd).to(tl.float32)
                     + tl.load(dt_ptr + hv * DK + kd).to(tl.float32))
            else:
                a = tl.load(zab + VH * DV + VH + hv).to(tl.float32) + tl.load(dt_ptr + hv).to(tl.float32)
            soft = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
            decay = tl.exp(tl.load(neg_a_ptr + hv) * soft)
            if KDA:
                decay = decay[:, None]
            s_src = state_ptr + (src * VH + hv) * DK * DV
            s_dst = state_ptr + (dst * VH + hv) * DK * DV
            o_base = out_ptr + r * VH * DV + hv * DV
            sq = 0.0
            for v0 in range(0, DV, BV):
                vd = v0 + tl.arange(0, BV)
                s = tl.load(s_src + kd[:, None] * DV + vd[None, :]) * decay      # [DK, BV]
                v = tl.load(row + 2 * KH * DK + hv * DV + vd).to(tl.float32)
                u = beta * (v - tl.sum(s * k[:, None], 0))
                s = s + k[:, None] * u[None, :]
                tl.store(s_dst + kd[:, None] * DV + vd[None, :], s)
                o = tl.sum(s * q[:, None], 0).to(out_ptr.dtype.element_ty)
                tl.store(o_base + vd, o)                    # rounded as the reference, normed below
                of = o.to(tl.float32)
                sq += tl.sum(of * of, 0)
            rstd = 1.0 / tl.sqrt(sq / DV + eps)
            for v0 in range(0, DV, BV):
                vd = v0 + tl.arange(0, BV)
                o = tl.load(o_base + vd).to(tl.float32)
                w = tl.load(w_ptr + vd).to(tl.float32)
                z = tl.load(zab + hv * DV + vd).to(tl.float32)
                if KDA:      # float32 throughout, sigmoid(gate), one rounding
                    gated = w * (o * rstd) / (1.0 + tl.exp(-z))
                else:
                    normed = (o * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
                    scaled = (w * normed).to(out_ptr.dtype.element_ty).to(tl.float32)
                    gated = scaled * (z / (1.0 + tl.exp(-z)))
                tl.store(o_base + vd, gated.to(out_ptr.dtype.element_ty))
            tl.debug_barrier()                     # the next row reads the state this one wrote
            src = dst
            r = _next_row(r, B, cont_ptr, CHAIN)


def supported(x: torch.Tensor, k_dim: int, v_dim: int) -> bool:
    return (x.dtype in (torch.float32, torch.bfloat16, torch.float16) and k_dim == next_pow2(k_dim)
            and v_dim == next_pow2(v_dim) and 8 <= k_dim <= 256 and 8 <= v_dim <= 256)


def conv_step(mixed: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
              chain: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``mixed [B, C]`` (rows may be strided), ``conv_state [S, K-1, C]`` (updated in place at
    ``slots [B]``), ``weight [C, K]`` -> SiLU(conv) ``[B, C]`` in ``mixed``'s dtype.

    ``chain = (dst [B], cont [B])``: rows in chains (a draft's verification as decode rows). Row
    r with ``cont[r] != 0`` is the next token of row r - 1's sequence and starts from the state
    row r - 1 left; a chain's first row starts from ``slots[r]``; every row writes the state after
    it into ``dst[r]`` (the draft's snapshot slots, the sequence's own slot last). Without it each
    row reads and writes ``slots[r]``."""
    bsz, c = mixed.shape
    k = weight.shape[1]
    y = torch.empty((bsz, c), dtype=mixed.dtype, device=mixed.device)
    block = 256
    dst, cont = chain if chain is not None else (slots, slots)
    _conv_kernel[(bsz, triton.cdiv(c, block))](mixed, mixed.stride(0), conv_state, slots, dst, cont, bsz, weight, y,
                                               c, K=k, BLOCK=block, CHAIN=chain is not None)
    return y


def recurrent_step(y: torch.Tensor, zab: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor, neg_a: torch.Tensor,
                   dt_bias: torch.Tensor, norm_w: torch.Tensor, k_heads: int, eps: float,
                   chain: tuple[torch.Tensor, torch.Tensor] | None = None, kda: bool = False) -> torch.Tensor:
    """``y [B, C]`` (``conv_step``'s), ``zab [B, >= V*dv + 2V]`` (rows holding z, b and a one after
    the other; strided), ``ssm [S, V, dk, dv]`` float32 (updated in place at ``slots``) ->
    the heads' normed, gated output ``[B, V * dv]`` in ``y``'s dtype. ``chain``: as ``conv_step``'s.
    ``kda``: Kimi Delta Attention, ``zab [B, >= V*dv + V + V*dk]`` (the gate, b, then the forget
    gate's output per head and channel), ``dt_bias [V*dk]``, ``neg_a [V]``."""
    bsz = y.shape[0]
    _, vh, dk, dv = ssm.shape
    out = torch.empty((bsz, vh * dv), dtype=y.dtype, device=y.device)
    dst, cont = chain if chain is not None else (slots, slots)
    _recurrent_kernel[(bsz, vh)](y, zab, zab.stride(0), ssm, slots, dst, cont, bsz, neg_a, dt_bias, norm_w, out, eps,
                                 k_heads, vh // k_heads, vh, DK=dk, DV=dv, BV=min(dv, 32), CHAIN=chain is not None,
                                 KDA=kda)
    return out
