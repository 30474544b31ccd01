"""Argument checks and packing for the compiled expert kernel's C entry points (cpu_experts.py):
which tensors the kernel takes, the clear errors for inconsistent ones, and the argument tuples of
``ft_experts_range`` / ``ft_experts_loop``."""
from __future__ import annotations

import torch

from .. import mxfp4
from ..mxfp4_rows import values_in

DT = {torch.float32: 0, torch.bfloat16: 1}
#: the kernel's weight kinds: uint8 weights are MXFP4 rows (kernels/mxfp4.py)
WT = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}


def values(w: torch.Tensor) -> int:
    """Values a row of ``w`` holds: its last dimension, or, for MXFP4 rows, what they encode
    (ValueError for a uint8 row of no MXFP4 size)."""
    n = w.shape[-1]
    return n if w.dtype != torch.uint8 else mxfp4.row_values(n)


def compiled_ok(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the compiled kernel takes these tensors (else the reference runs: same result)."""
    # cheapest tests first: this runs once per MoE layer call (the decode hot path)
    return (x.is_cpu and w13.is_cpu and w2.is_cpu
            and x.dtype in DT and w13.dtype in WT and w2.dtype == w13.dtype
            and w13.stride(-1) == 1 and w2.stride(-1) == 1
            and not ((x.requires_grad or w13.requires_grad) and torch.is_grad_enabled()))


def as_int64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous int64 tensor (itself when it already is one)."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def problem_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> tuple:
    """The leading arguments of ft_experts_range / ft_experts_loop: x (contiguous) and the bank."""
    (T, H), E, I = x.shape, w2.shape[0], values(w2)
    return (x.data_ptr(), DT[x.dtype], T, H, I, w13.data_ptr(), w2.data_ptr(), WT[w13.dtype], E,
            w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1))


def check_problem(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, pair_tok: torch.Tensor,
                   pair_exp: torch.Tensor) -> None:
    """ValueError unless x [T, H], w13 [E, 2I, H], w2 [E, H, I] and equal 1-D pair tensors."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [T,H], w13 [E,2I,H], w2 [E,H,I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    H, E = x.shape[1], w2.shape[0]
    if (w13.dtype == torch.uint8) != (w2.dtype == torch.uint8):
        raise ValueError(f"w13 {w13.dtype} and w2 {w2.dtype}: MXFP4 rows (uint8) for both or neither")
    I = values(w2)
    if tuple(w13.shape[:2]) != (E, 2 * I) or values(w13) != H or w2.shape[1] != H:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if pair_tok.shape != pair_exp.shape or pair_tok.dim() != 1:
        raise ValueError(f"pair_tok {tuple(pair_tok.shape)} and pair_exp {tuple(pair_exp.shape)} must be equal 1-D")


def fast_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, pair_tok: torch.Tensor,
               pair_exp: torch.Tensor, out: torch.Tensor | None, rows_from: int) -> tuple | None:
    """ft_experts_range's arguments but the output pointer, for the decode hot path's usual call
    (consistent shapes, CPU tensors the kernel takes, contiguous x and int64 pairs, no grad, a
    valid ``out`` or none), each tensor attribute read once: on the H200 host's Xeon the general
    checks, the argument tuple and the output allocation cost 15-20 us of a 1-expert call's
    100 (docs/cpu_kernel.md). None: anything else, which ``experts_forward`` then checks, converts or
    refuses in full."""
    xs, s13, s2, ps = x.shape, w13.shape, w2.shape, pair_tok.shape
    if len(xs) != 2 or len(s13) != 3 or len(s2) != 3 or len(ps) != 1 or ps != pair_exp.shape:
        return None
    T, H = xs
    E, H2, I = s2
    dx, dw = DT.get(x.dtype), WT.get(w13.dtype)
    if dw == 2:                                 # MXFP4 rows: whole experts only
        I = values_in(I)
        if rows_from or I is None or H % 32:
            return None
        K = mxfp4.row_bytes(H)
    else:
        K = H
    if s13[0] != E or s13[1] != 2 * I or s13[2] != K or H2 != H or not 0 <= rows_from < I:
        return None
    if dx is None or dw is None or w2.dtype != w13.dtype or pair_tok.dtype != torch.int64 or pair_exp.dtype != torch.int64:
        return None
    st13, st2 = w13.stride(), w2.stride()
    if st13[2] != 1 or st2[2] != 1 or not (x.is_cpu and w13.is_cpu and w2.is_cpu and x.is_contiguous()
                                           and pair_tok.is_contiguous() and pair_exp.is_contiguous()):
        return None
    if (x.requires_grad or w13.requires_grad) and torch.is_grad_enabled():
        return None
    if out is not None and (out.shape != (ps[0], H) or out.dtype != x.dtype or not out.is_cpu
                            or not out.is_contiguous()):
        return None
    return (x.data_ptr(), dx, T, H, I, w13.data_ptr(), w2.data_ptr(), dw, E, st13[0], st13[1], st2[0], st2[1],
            pair_tok.data_ptr(), pair_exp.data_ptr(), ps[0])
