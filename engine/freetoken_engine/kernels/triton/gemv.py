"""Dense projections of a decode step on the GPU: ``linear(x, w, b)`` for 1-16 tokens in one launch.

A decode step multiplies a few token vectors by every weight matrix of the attention (the fused
q/k/v projection, the output projection), the router, the shared expert and the LM head:
matrix-vector products bounded by reading the weights from HBM once, and short enough (5-10 us)
that how many reads a kernel keeps in flight decides its speed. Two kernels:

- ``lanes`` (one token): a program owns BLOCK_N weight rows and streams them along K in blocks
  of up to 2048 (16 KB in flight per program), multiplying in fp32 and summing lanes
  elementwise until one reduction at the end.
- ``mma`` (2-16 tokens): the tensor cores compute out^T = w @ x^T, 16 weight rows against the
  tokens padded to 16 columns (the padding masked, never read), 256 of K a step with four
  pipeline stages. A token's column never mixes with the others, so its result is the same
  with 2 to 16 tokens.

On the H200 (``bench/gemv.py --sweep``, bench/results/gemv_gpu_sweep.json; inside CUDA graphs,
weights read from HBM) each was the best of 88 configurations for its batch by the geometric mean
over four shapes of time / the shape's best: 1.03x, 1.11x, 1.06x at 1, 2, 4 tokens, where cuBLAS
measured 1.60x, 1.40x, 1.35x; at 8 and 16 tokens (bench/results/gemv_gpu_8_16.json) the same ``mma``
configuration was the best, 1.02x and 1.03x, cuBLAS 1.15x and 1.13x. One token on an LM head's rows
goes to ``mma`` (``MMA_ROWS``).

Same computation as ``F.linear``: ``out[t] = w @ x[t] (+ b)`` in x's dtype, fp32 accumulation
(fp32 data multiplied in full precision, never TF32), the bias added in fp32, one rounding at
the end. Only the order of the additions differs, so the tolerance
(tests/engine/test_triton_gemv.py) is the CPU kernel's: float32
``|y - ref| <= 1e-5 (|x| . |w|) + 1e-6`` per element; 16-bit one rounding,
``|y - ref32| <= 2^-8 |ref32| + 1e-5 (|x| . |w|)`` against the fp32 sum of the same inputs
(2^-7 under Triton's interpreter, which truncates instead of rounding; there the 16-bit ``mma``
multiplies in fp32, as the interpreter's bf16 dot is wrong).

Computes it for 2-D x of 1 to ``MAX_TOKENS`` rows, x and w of one dtype (fp32, bf16, fp16),
unit stride along K, no autograd; layers/linear.py sends a GPU decode step's projections here
(FREETOKEN_GPU_DECODE_KERNELS name ``gemv``), everything else goes to ``F.linear``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting, next_pow2

MAX_TOKENS = 16
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _row_tile(row_ptrs, kk, rmask, K, EVEN_K: tl.constexpr):
    """Elements ``kk`` of the rows at ``row_ptrs`` ([R, 1] pointers) as an [R, len(kk)] tile; rows
    outside ``rmask``, and without EVEN_K columns past K, read as 0."""
    mask = rmask[:, None]
    if not EVEN_K:
        mask = mask & (kk < K)[None, :]
    return tl.load(row_ptrs + kk[None, :], mask=mask, other=0.0)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_x, stride_w, stride_o,
                 M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    toks = tl.arange(0, M_PAD)
    tmask = toks < M
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w            # [BLOCK_N, 1]
    x_rows = x_ptr + toks.to(tl.int64)[:, None] * stride_x            # [M_PAD, 1]
    acc = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        w = _row_tile(w_rows, kk, rmask, K, EVEN_K)
        x = _row_tile(x_rows, kk, tmask, K, EVEN_K)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)                                            # [M_PAD, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + toks.to(tl.int64)[:, None] * stride_o + rows[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & rmask[None, :])


@triton.jit
def _gemv_mma_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
                     T_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """out^T = w @ x^T on the tensor cores: BLOCK_N weight rows against the tokens as T_PAD
    columns (the padding masked, never read), so the loop's loads are software-pipelined."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    toks = tl.arange(0, T_PAD)
    tmask = toks < M
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w            # [BLOCK_N, 1]
    x_cols = x_ptr + toks.to(tl.int64)[None, :] * stride_x            # [1, T_PAD]
    acc = tl.zeros((BLOCK_N, T_PAD), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        w = _row_tile(w_rows, kk, rmask, K, EVEN_K)
        xmask = tmask[None, :]
        if not EVEN_K:
            xmask = xmask & (kk < K)[:, None]
        xt = tl.load(x_cols + kk[:, None], mask=xmask, other=0.0)
        if UPCAST:      # fp32 data (no TF32), or 16-bit under the interpreter (its bf16 dot is wrong)
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + toks.to(tl.int64)[None, :] * stride_o + rows[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & tmask[None, :])


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear`` computes ``F.linear(x, weight, bias)`` here (see the module docstring)."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_TOKENS and x.dtype in _DTYPES and weight.dtype == x.dtype
            and weight.dim() == 2 and x.shape[1] == weight.shape[1] > 0 and weight.shape[0] > 0
            and x.stride(1) == 1 and weight.stride(1) == 1 and x.device == weight.device
            and (bias is None or (bias.dtype == x.dtype and bias.dim() == 1 and bias.numel() == weight.shape[0]
                                  and bias.is_contiguous() and bias.device == x.device))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))


def blocks(m: int, k: int) -> tuple[int, int, int]:
    """The ``lanes`` kernel's (BLOCK_N, BLOCK_K, warps) for m tokens and K: BLOCK_K and the warps
    depend on K alone (a token's sums are taken over the same blocks whatever the batch), and
    fewer rows a program as tokens grow keep the accumulators (M_PAD x BLOCK_N x BLOCK_K fp32)
    within 8192 values."""
    bk = min(2048, next_pow2(k))
    return max(1, min(4, 8192 // (next_pow2(m) * bk))), bk, 4


#: from this many weight rows on, one token goes to ``mma`` too: on the H200 an LM head of 151936
#: rows ran 0.90x cuBLAS in ``lanes`` (run 101) and 1.03x in ``mma`` (run 102)
MMA_ROWS = 65536


def default_config(m: int, k: int, n: int = 0) -> tuple:
    """What ``linear`` runs m tokens of K (N rows) with: ``lanes`` for one token, ``mma`` for
    more, and for an LM head's N rows."""
    if m == 1 and n < MMA_ROWS:
        return ("lanes",) + blocks(m, k)
    return ("mma", 16, min(256, max(16, next_pow2(k))), 2, 4)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: tuple | None = None) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_TOKENS); weight [N, K]; bias [N] or None -> [M, N] in x's dtype.
    ``config``: ("lanes", BLOCK_N, BLOCK_K, warps) or ("mma", BLOCK_N, BLOCK_K, warps, stages) in
    place of ``default_config``'s choice (the benchmark's sweep)."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    kind, bn, bk, warps, *stages = config or default_config(m, k, n)
    b = weight if bias is None else bias
    even = k % bk == 0
    grid = (triton.cdiv(n, bn),)
    if kind == "mma":
        _gemv_mma_kernel[grid](x, weight, b, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                               T_PAD=16, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias is not None, EVEN_K=even,
                               UPCAST=x.dtype == torch.float32 or interpreting(), num_warps=warps,
                               num_stages=stages[0])
    else:
        _gemv_kernel[grid](x, weight, b, out, n, k, x.stride(0), weight.stride(0), out.stride(0), M=m,
                           M_PAD=next_pow2(m), BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias is not None, EVEN_K=even,
                           num_warps=warps)
    return out
