"""The compiled CPU expert kernel's entry for experts of another kind than silu(gate) * up
(gpt-oss: gate/up biases and the clamped gate, ``ft_experts_gated``; gate.h ``gated_block``)."""
from __future__ import annotations

import torch

from .. import reference
from .expert_args import as_int64, check_problem, compiled_ok, problem_args, values

ACTS = {"silu": 0, "swiglu_oai": 1}    # the kernel's gate_act


def gated_forward(lib, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, pair_tok: torch.Tensor,
                  pair_exp: torch.Tensor, out: torch.Tensor | None, act: reference.GatedAct,
                  b13: torch.Tensor | None, pair_bias: torch.Tensor | None) -> torch.Tensor:
    """``cpu_experts.experts_forward`` for experts of another kind: the compiled kernel ``lib``
    (None: unavailable) with the gate and the gate/up biases in its first stage (b13 read as
    float32 rows: pass a float32 contiguous copy to save a conversion a call); the reference where
    the kernel does not take the tensors. Raises ValueError / IndexError as ``experts_forward``."""
    check_problem(x, w13, w2, pair_tok, pair_exp)
    P, H, I = pair_tok.numel(), x.shape[1], values(w2)
    if out is not None and (out.shape != (P, H) or out.dtype != x.dtype or out.device.type != "cpu"
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous CPU [{P}, {H}] {x.dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    bias = pair_exp if pair_bias is None else pair_bias
    if b13 is not None and (b13.dim() != 2 or b13.shape[1] != 2 * I or bias.shape != pair_exp.shape):
        raise ValueError(f"b13 must be [experts, {2 * I}] with a row per pair, got {tuple(b13.shape)} and "
                         f"pair_bias {tuple(bias.shape)}")
    if P == 0 or lib is None or not compiled_ok(x, w13, w2) or act.kind not in ACTS \
            or (b13 is not None and not b13.is_cpu):
        y = reference.expert_pairs_forward(x, w13, w2, pair_tok, pair_exp, act, b13, pair_bias)
        return y if out is None else out.copy_(y)
    x = x.contiguous()
    tok, exp = as_int64(pair_tok), as_int64(pair_exp)
    rows = None if b13 is None else b13.float().contiguous()
    rows_at = as_int64(bias) if rows is not None else None
    if out is None:
        out = torch.empty((P, H), dtype=x.dtype)
    rc = lib.ft_experts_gated(*problem_args(x, w13, w2), tok.data_ptr(), exp.data_ptr(), P, out.data_ptr(),
                              ACTS[act.kind], act.alpha, act.limit, None if rows is None else rows.data_ptr(),
                              0 if rows is None else rows.shape[0], None if rows_at is None else rows_at.data_ptr())
    if rc != 0:
        raise IndexError(lib.ft_last_error().decode())
    return out
