"""Decode's CPU branch inside one CUDA graph: a flag handshake through pinned host memory.

With the q* split some of a layer's missed experts are computed on the CPU, so a decode step
cannot run on the device alone. Instead of returning to Python between layers (two graph
launches, an event and a Python call per layer: 67 us per layer measured on the H200, on the
critical path), the device runs the whole step as one graph and a C++ loop on the host
(``kernels/cpu/branch.cpp``) answers it layer by layer. For decode step ``e`` (the ``epoch``)
and MoE layer ``l``:

    device (one graph)                             host (ft_branch_run, GIL released)
    control(l), mirroring pair slots, routed  ->   waits for flag[l] >= e
      experts and the layer input to pinned        computes the pairs with slot -1 straight
    signal(flag[l])  [fence.sc.sys; store e]       from the bank (the CPU expert kernel),
    fills(l), GPU experts(l)                       writes their rows compactly (pair order)
    wait(done[l] >= e)  [bounded spin]       <-    done[l] = e (release)
    combine(l): GPU rows + host rows

The CPU experts overlap the fills and the GPU experts of the same layer, as before; what goes
away is Python and the launches. The device never hangs on a dead host (``wait`` gives up
after a bounded number of polls and flags ``err``) and the host never hangs on a dead device
(``timeout_s`` per layer).

Buffers (``CpuBranch``): ``flag``, ``done`` [L] int64; ``pair_slot``, ``pair_exp`` [L, P] int64;
``x`` [L, T, H] bf16 (the layer inputs); ``rows`` [P, H] bf16; pinned when CUDA is present.
On the device: ``epoch`` and ``err`` [1] int64. Steps are numbered from 1 in lock step:
every ``bump(epoch)`` on the device is matched by exactly one ``run()`` on the host.
"""
from __future__ import annotations

import ctypes

import torch

from .cpu_experts import _load

_i64, _vp = ctypes.c_int64, ctypes.c_void_p


class _FtBranch(ctypes.Structure):   # FtBranch in kernels/cpu/branch.cpp, field for field
    _fields_ = [("L", _i64), ("P", _i64), ("T", _i64), ("H", _i64), ("I", _i64), ("E", _i64),
                ("flag", _vp), ("done", _vp), ("pair_slot", _vp), ("pair_exp", _vp), ("pair_tok", _vp),
                ("x", _vp), ("w13", _vp), ("w2", _vp),
                ("w13_ls", _i64), ("w13_es", _i64), ("w13_rs", _i64), ("w2_ls", _i64), ("w2_es", _i64),
                ("w2_rs", _i64), ("rows", _vp), ("timeout_s", ctypes.c_double),
                ("wait_s", ctypes.c_double), ("compute_s", ctypes.c_double),
                ("cpu_layers", _i64), ("cpu_pairs", _i64), ("failed_layer", _i64)]


class CpuBranch:
    """Host buffers and the host loop of the handshake (see the module docstring).

    bank_w13 [L, E, 2I, H] and bank_w2 [L, E, H, I]: bf16 host tensors with unit last stride
    (the expert bank); ``tokens`` T and ``top_k`` k give the P = T k pairs of one call; the pair
    order is token-major, as the control step's. ``device``: where ``epoch`` / ``err`` live.
    """

    def __init__(self, bank_w13: torch.Tensor, bank_w2: torch.Tensor, tokens: int, top_k: int,
                 device: torch.device, timeout_s: float = 10.0):
        lib = _load()
        if lib is None:
            raise RuntimeError("the CPU branch needs the compiled CPU kernel (kernels/cpu/build.py)")
        if bank_w13.dtype != torch.bfloat16 or bank_w2.dtype != torch.bfloat16:
            raise ValueError(f"bank must be bf16, got {bank_w13.dtype} / {bank_w2.dtype}")
        if bank_w13.device.type != "cpu" or bank_w13.stride(-1) != 1 or bank_w2.stride(-1) != 1:
            raise ValueError("bank tensors must be host tensors with a unit stride in their last dim")
        L, E, two_i, H = bank_w13.shape
        P = tokens * top_k
        if P > 1024:
            raise ValueError(f"at most 1024 pairs per call, got {tokens} x {top_k}")
        self._lib, self.device = lib, torch.device(device)
        pin = self.device.type == "cuda"

        def host(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self.flag, self.done = host(L), host(L)
        self.pair_slot, self.pair_exp = host(L, P), host(L, P)
        self.pair_tok = torch.arange(tokens).repeat_interleave(top_k)
        self.x = host(L, tokens, H, dtype=torch.bfloat16)
        self.rows = host(P, H, dtype=torch.bfloat16)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.err = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.host_epoch = 0
        self._bank = (bank_w13, bank_w2)
        s13, s2 = bank_w13.stride(), bank_w2.stride()
        self._c = _FtBranch(L, P, tokens, H, two_i // 2, E,
                            *(t.data_ptr() for t in (self.flag, self.done, self.pair_slot, self.pair_exp,
                                                     self.pair_tok, self.x, bank_w13, bank_w2)),
                            s13[0], s13[1], s13[2], s2[0], s2[1], s2[2], self.rows.data_ptr(), timeout_s,
                            0.0, 0.0, 0, 0, -1)
        self.totals = {"wait_s": 0.0, "compute_s": 0.0, "cpu_layers": 0, "cpu_pairs": 0, "steps": 0}

    def run(self, timeout_s: float | None = None) -> None:
        """The host half of the next step (blocks until its last layer's rows are published).
        ``timeout_s``: per-layer wait for this step (default: the constructor's; a first step
        that compiles kernels needs more). Raises RuntimeError when the device did not reach a
        layer in time or a pair is invalid."""
        self.host_epoch += 1
        c = self._c
        default, c.timeout_s = c.timeout_s, timeout_s or c.timeout_s
        try:
            rc = self._lib.ft_branch_run(ctypes.addressof(c), self.host_epoch)
        finally:
            c.timeout_s = default
        if rc == -2:
            raise RuntimeError(f"CPU branch: the device did not publish layer {c.failed_layer} of step "
                               f"{self.host_epoch} within {c.timeout_s} s")
        if rc != 0:
            raise RuntimeError(f"CPU branch, layer {c.failed_layer}: {self._lib.ft_last_error().decode()}")
        for name in ("wait_s", "compute_s", "cpu_layers", "cpu_pairs"):
            self.totals[name] += getattr(c, name)
        self.totals["steps"] += 1

    def check(self) -> None:
        """After a sync: raise RuntimeError if a device ``wait`` timed out (that step is invalid)."""
        bad = int(self.err.item())
        if bad:
            raise RuntimeError(f"CPU branch: the device stopped waiting for the host in step {bad}")
