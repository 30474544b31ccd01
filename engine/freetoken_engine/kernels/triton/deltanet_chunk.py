"""The state hand-over of a prompt's chunked Gated DeltaNet (``layers/deltanet.py``:
``delta_rule_chunked``) in one launch; torch's ops take about nine a chunk, 1,152 for an
8192-token prompt's 128 chunks in each layer, issued one after the other from Python.

Everything inside the chunks is computed for all of them at once beforehand (``chunk_parts``:
batched matrix products and one triangular solve). What is left is sequential: chunk i's
state S enters chunk i+1. Per chunk, with U = UB - W S::

    O = QG S + A U,    S <- carry S + KE^T U

One program per (value head, block of BV value dimensions) keeps its [dk, BV] slice of S in
registers and walks the chunks: the columns of S are independent, so the blocks need no
exchange. Products as three TF32 tensor-core products each (``tf32x3``: float32's accuracy; plain
float32 FMAs ran at half torch's speed on the H200; tf32x3 hands over 8192 tokens' 128 chunks
9.6x faster than the first torch form and 5.2x faster than ``_hand_over``, device run 144,
bench/results/deltanet_prefill.json), in the reference's order: the tests
(tests/engine/test_triton_deltanet.py) hold it to 1e-5 relative of the reference's loop.

Shared memory: the next chunk's tiles are loaded while one computes (two pipeline stages, 155 KB
at Qwen3.6's 64 x 128 tiles in tf32x3, within a Hopper SM's 227 KB); a card with less (consumer
cards have 99 KB a block) gets one stage (32 KB on sm_89; 64 KB at k_dim 256), which the kernel's
first launch finds out (Triton refuses the launch before it runs) and remembers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2

_stages: dict[tuple, int] = {}       # (device, C, k_dim, v_dim) -> pipeline stages that fit


@triton.jit
def _states_kernel(ub_ptr, w_ptr, qg_ptr, a_ptr, ke_ptr, carry_ptr, s_ptr, out_ptr, s_out_ptr, N,
                   su0, su1, su2, su3, sw0, sw1, sw2, sw3, sq0, sq1, sq2, sq3, sa0, sa1, sa2, sa3,
                   sk0, sk1, sk2, sk3, sc0, sc1,
                   C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    rc = tl.arange(0, C)
    rk = tl.arange(0, DK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    s_off = h * DK * DV + rk[:, None] * DV + rv[None, :]
    s = tl.load(s_ptr + s_off)                                                  # [DK, BV] float32
    for i in range(N):
        w = tl.load(w_ptr + h * sw0 + i * sw1 + rc[:, None] * sw2 + rk[None, :] * sw3)    # [C, DK]
        u = tl.load(ub_ptr + h * su0 + i * su1 + rc[:, None] * su2 + rv[None, :] * su3) \
            - tl.dot(w, s, input_precision=PRECISION)                                          # [C, BV]
        qg = tl.load(qg_ptr + h * sq0 + i * sq1 + rc[:, None] * sq2 + rk[None, :] * sq3)  # [C, DK]
        a = tl.load(a_ptr + h * sa0 + i * sa1 + rc[:, None] * sa2 + rc[None, :] * sa3)    # [C, C]
        o = tl.dot(qg, s, input_precision=PRECISION) + tl.dot(a, u, input_precision=PRECISION)
        tl.store(out_ptr + ((h * N + i) * C + rc[:, None]) * DV + rv[None, :], o)
        ke = tl.load(ke_ptr + h * sk0 + i * sk1 + rc[:, None] * sk2 + rk[None, :] * sk3)  # [C, DK]
        s = tl.load(carry_ptr + h * sc0 + i * sc1) * s + tl.dot(tl.trans(ke), u, input_precision=PRECISION)
    tl.store(s_out_ptr + s_off, s)


def supported(k_dim: int, v_dim: int, chunk: int) -> bool:
    """The shapes the kernel takes: powers of two, each at least 16 (a dot's smallest side), and
    chunks of at most 64 tokens (one stage of their tiles fits 99 KB of shared memory)."""
    return all(n == next_pow2(n) and 16 <= n <= 256 for n in (k_dim, v_dim, chunk)) and chunk <= 64


def chunk_states(ub: torch.Tensor, w: torch.Tensor, qg: torch.Tensor, attn: torch.Tensor, ke: torch.Tensor,
                 carry: torch.Tensor, state: torch.Tensor, precision: str = "tf32x3") -> tuple[torch.Tensor, torch.Tensor]:
    """``ub [h, N, C, dv]``, ``w``/``qg``/``ke [h, N, C, dk]``, ``attn [h, N, C, C]``,
    ``carry [h, N]`` and the entering ``state [h, dk, dv]``, all float32
    -> (``o [h, N, C, dv]``, the state after the last chunk). Any strides (the triangular
    solve's results are column-major); a unit stride is specialised when compiled.
    ``precision``: the products' (Triton's ``input_precision``): "tf32x3" (three TF32 tensor-core
    products, about float32's accuracy) or "ieee" (float32 FMAs)."""
    h, n, c, dv = ub.shape
    dk = w.shape[-1]
    for name, t in (("ub", ub), ("w", w), ("qg", qg), ("attn", attn), ("ke", ke)):
        if t.dtype != torch.float32 or t.shape[:3] != (h, n, c) or t.shape[3] != (dv if name == "ub" else c if
                                                                              name == "attn" else dk):
            raise ValueError(f"{name}: float32 [h={h}, N={n}, C={c}, *] expected, got {t.dtype} {tuple(t.shape)}")
    state = state.contiguous()
    out = torch.empty((h, n, c, dv), dtype=torch.float32, device=ub.device)
    new = torch.empty_like(state)
    bv = min(dv, 32)
    key = (ub.device, c, dk, dv)
    stages = _stages.get(key, 2)
    while True:
        try:
            _states_kernel[(h, dv // bv)](ub, w, qg, attn, ke, carry, state, out, new, n,
                                          *ub.stride(), *w.stride(), *qg.stride(), *attn.stride(), *ke.stride(),
                                          *carry.stride(), C=c, DK=dk, DV=dv, BV=bv, PRECISION=precision,
                                          num_stages=stages)
        except triton.runtime.errors.OutOfResources:
            if stages == 1:
                raise
            stages = 1                                  # a card with less shared memory
            continue
        _stages[key] = stages
        return out, new
