"""Fused CPU decode layers: a plain decoder layer's decode step in two compiled calls (layer.cpp).

A decode step of a pre-norm attention + MoE layer ran about forty torch ops and Python calls
around the compiled kernels (norms, projections, attention, experts): 260 us a layer on the
2-core Xeon VM, a third of the default model's decode time. ``FusedLayer`` chains the same
kernels in C on the same values and adds the residual adds and the MoE combine the way torch
rounds them, so the result is bit for bit the unfused path's:

    x2 = layer.attn(step, h, k_cache, v_cache)     # [B, H]: norm, qkv, attention, o, add, norm
    weights, ids = router(x2)                      # torch (the model's own routing code)
    shared = shared_expert(x2)                     # torch, when the layer has one (else None)
    h = layer.moe(B, ids, weights, shared)         # [B, H]: experts, combine, residual add

A layer with a dense MLP takes the attention half only (its MLP runs on ``x2`` with the residual
``layer.h2(B)``). The tensors returned are views of scratch that the next call of any layer
sharing that scratch overwrites (two output buffers alternate, by layer parity, so a layer's
input is never its output). ``executor/cpu_decode.py`` decides which layers qualify and drives
the passes.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .. import cpu_experts, reference
from .attention import _FtAttn
from .expert_args import fast_args
from .gated import ACTS

_i64, _vp, _ci, _cf = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_DT = {torch.float32: 0, torch.bfloat16: 1}
MAX_ROWS = 8       # the compiled projections' and norms' decode sizes (linear.py, norm.py)


class _FtProj(ctypes.Structure):     # FtProj in layer.cpp
    _fields_ = [("w", _vp), ("w_bf16", _ci), ("N", _i64), ("K", _i64), ("rs", _i64), ("bias", _vp)]


class _FtLayer(ctypes.Structure):    # FtLayer in layer.cpp, field for field
    _fields_ = [("H", _i64), ("bf16", _ci), ("in_norm", _vp), ("in_eps", _cf), ("post_norm", _vp),
                ("post_eps", _cf), ("qkv", _FtProj), ("o", _FtProj), ("attn", _FtAttn),
                ("I", _i64), ("E", _i64), ("k", _i64), ("w13", _vp), ("w2", _vp), ("w_kind", _ci),
                ("w13_es", _i64), ("w13_rs", _i64), ("w2_es", _i64), ("w2_rs", _i64), ("gate_act", _ci),
                ("alpha", _cf), ("limit", _cf), ("b13", _vp), ("pair_tok", _vp),
                ("x", _vp), ("qkv_out", _vp), ("o_in", _vp), ("a", _vp), ("h2", _vp), ("x2", _vp),
                ("rows", _vp), ("out", _vp)]


class _FtStep(ctypes.Structure):     # FtStep in layer.cpp
    _fields_ = [("B", _i64), ("cos", _vp), ("sin", _vp), ("rot", _i64), ("slot", _vp), ("kv_index", _vp),
                ("lmax", _i64), ("kv_len", _vp), ("write_first", _ci)]


def projection_ok(w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether the compiled decode projection takes this weight for ``dtype`` rows (linear.py's test)."""
    return (w.dim() == 2 and w.device.type == "cpu" and w.stride(-1) == 1
            and (w.dtype == dtype or (dtype == torch.float32 and w.dtype == torch.bfloat16))
            and (b is None or (b.dtype == w.dtype and b.is_contiguous())))


def _proj(w: torch.Tensor, b: torch.Tensor | None) -> _FtProj:
    return _FtProj(w.data_ptr(), _DT[w.dtype], w.shape[0], w.shape[1], w.stride(0), None if b is None else b.data_ptr())


@dataclass
class AttnWeights:
    """A layer's attention half, as the unfused path passes it to the kernels."""
    in_norm: torch.Tensor               # [H]
    in_eps: float
    qkv: tuple[torch.Tensor, torch.Tensor | None]     # [(h + 2 kvh) d, H], bias
    o: tuple[torch.Tensor, torch.Tensor | None]       # [H, h d], bias
    post_norm: torch.Tensor             # [H]
    post_eps: float
    heads: int
    kv_heads: int
    head_dim: int
    q_norm: torch.Tensor | None         # [d] per-head norms, or None
    k_norm: torch.Tensor | None
    qk_eps: float
    scale: float
    window: int | None
    chunk: int | None
    sinks: torch.Tensor | None          # [h] float32, or None


class Scratch:
    """Buffers shared by the fused layers of one model (one pass at a time)."""

    def __init__(self, dtype: torch.dtype, hidden: int, qkv: int, heads_dim: int, top_k: int):
        e = lambda n: torch.empty((MAX_ROWS, n), dtype=dtype)   # noqa: E731
        self.x, self.qkv, self.o, self.a, self.h2, self.x2 = e(hidden), e(qkv), e(heads_dim), e(hidden), e(hidden), e(hidden)
        self.rows = torch.empty((MAX_ROWS * top_k, hidden), dtype=dtype)
        self.out = (e(hidden), e(hidden))
        self.pair_tok = torch.arange(MAX_ROWS).repeat_interleave(top_k)     # [t k + j] = t
        self.views: dict[tuple[str, int], torch.Tensor] = {}

    def view(self, name: str, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of buffer ``name`` ("x2", "h2", "out0", "out1"), made once."""
        got = self.views.get((name, rows))
        if got is None:
            buf = self.out[int(name[-1])] if name.startswith("out") else getattr(self, name)
            got = self.views[name, rows] = buf[:rows]
        return got


class Step:
    """One decode pass's rows as the fused layers read them (``FtStep``); ``rotary`` sets the
    cos / sin a layer rotates by before its call."""

    def __init__(self, rows: int, slot: torch.Tensor, kv_index: torch.Tensor, kv_len: torch.Tensor,
                 write_first: bool):
        self._keep = (slot, kv_index, kv_len)
        self.s = _FtStep(rows, None, None, 0, slot.data_ptr(), kv_index.data_ptr(), kv_index.shape[1],
                         kv_len.data_ptr(), int(write_first))
        self.ptr = ctypes.addressof(self.s)
        self._rot: tuple[int, int] = (0, 0)
        self._keep_rot: tuple[torch.Tensor, torch.Tensor] | None = None     # the tensors s.cos / s.sin point into

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """The next layer's cos / signed sin ``[B, 1, rot]`` (contiguous, the activations' dtype)."""
        key = (cos.data_ptr(), sin.data_ptr())
        if key != self._rot:
            self._rot = key
            self.s.cos, self.s.sin, self.s.rot = key[0], key[1], cos.shape[-1]
            self._keep_rot = (cos, sin)


class FusedLayer:
    """One layer's decode step in two calls (see the module docstring): ``attn`` its attention
    half (None: the layer's modules run it, and ``moe`` takes their x2 and h2), ``w13`` / ``w2``
    its experts' bank layer (None: a dense MLP, the attention half only); experts of another
    kind (gpt-oss) with their ``act`` and ``b13`` [E, 2I] float32 gate/up biases (or None).
    ``parity``: which output buffer it writes (alternate between consecutive layers). ValueError
    when the compiled kernels do not take the experts."""

    def __init__(self, attn: AttnWeights | None, w13: torch.Tensor | None, w2: torch.Tensor | None, top_k: int,
                 scratch: Scratch, parity: int, act: reference.GatedAct = reference.SILU,
                 b13: torch.Tensor | None = None):
        s, dtype = scratch, scratch.x.dtype
        self.lib = cpu_experts._load()
        inter = p13 = p2 = kind = experts = es13 = rs13 = es2 = rs2 = 0
        if w13 is not None:
            args = fast_args(s.x[:1], w13, w2, s.pair_tok[:top_k], s.pair_tok[:top_k], None, 0)
            if args is None or self.lib is None:
                raise ValueError("the compiled kernels do not take this layer's experts")
            _, _, _, _, inter, p13, p2, kind, experts, es13, rs13, es2, rs2, *_ = args
        elif self.lib is None or attn is None:
            raise ValueError("nothing to fuse" if self.lib else "no compiled kernels")
        if act.kind not in ACTS or (b13 is not None and not (b13.dtype == torch.float32 and b13.is_contiguous()
                                                               and tuple(b13.shape) == (experts, 2 * inter))):
            raise ValueError(f"experts of kind {act.kind} with biases {None if b13 is None else tuple(b13.shape)}")
        self._keep = (attn, w13, w2, scratch, b13)
        a = attn
        ptr = lambda t: None if t is None else t.data_ptr()     # noqa: E731
        if a is not None:
            spec = _FtAttn(0, a.heads, a.kv_heads, a.head_dim, None, ptr(a.q_norm), ptr(a.k_norm), a.qk_eps, None,
                           None, None, None, None, None, 0, None, a.window or 0, a.scale, _DT[dtype], 0, None, None, 0,
                           0, ptr(a.sinks), a.chunk or 0)
            half = (a.in_norm.data_ptr(), a.in_eps, a.post_norm.data_ptr(), a.post_eps, _proj(*a.qkv), _proj(*a.o), spec)
        else:
            half = (None, 0.0, None, 0.0, _FtProj(), _FtProj(), _FtAttn())
        self.s = _FtLayer(s.x.shape[1], _DT[dtype], *half, inter, experts, top_k, p13, p2, kind, es13, rs13, es2,
                          rs2, ACTS[act.kind], act.alpha, act.limit, ptr(b13), s.pair_tok.data_ptr(), s.x.data_ptr(),
                          s.qkv.data_ptr(), s.o.data_ptr(), s.a.data_ptr(), s.h2.data_ptr(), s.x2.data_ptr(),
                          s.rows.data_ptr(), s.out[parity].data_ptr())
        self.ptr = ctypes.addressof(self.s)
        self.scratch, self.out, self.dense, self.attn_fused = scratch, f"out{parity}", w13 is None, a is not None
        self._halves = (s.x2.data_ptr(), s.h2.data_ptr())

    def attn(self, step: Step, h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """The attention half of ``h [B, H]`` (contiguous, the scratch's dtype): returns x2 [B, H],
        the MLP's input; writes the new tokens' K/V."""
        if self.lib.ft_layer_attn(self.ptr, step.ptr, h.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()):
            raise ValueError(self.lib.ft_last_error().decode())
        return self.scratch.view("x2", step.s.B)

    def h2(self, rows: int) -> torch.Tensor:
        """The residual after the attention half ``[rows, H]`` (the MLP's residual)."""
        return self.scratch.view("h2", rows)

    def moe(self, rows: int, ids: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
            halves: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The MoE half for the router's ``ids [B, k]`` (int64), ``weights [B, k]`` and the shared
        expert's ``shared [B, H]`` or None; ``halves``: (x2, h2) where the layer's modules ran the
        attention half (default: ``attn``'s). Tensors contiguous, in the scratch's dtype. Returns
        the layer's output [B, H]. IndexError for an expert id out of range."""
        x2, h2 = self._halves if halves is None else (halves[0].data_ptr(), halves[1].data_ptr())
        if self.lib.ft_layer_moe(self.ptr, rows, ids.data_ptr(), weights.data_ptr(),
                                 None if shared is None else shared.data_ptr(), x2, h2):
            raise IndexError(self.lib.ft_last_error().decode())
        return self.scratch.view(self.out, rows)
