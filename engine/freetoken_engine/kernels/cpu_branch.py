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

Streamed split (optional): a pair mirrored with slot -2 has its expert's intermediate rows
[0, from_rows[l]) streamed to the GPU and computed there (``kernels/triton/stream.py``); the host
computes the rest, rows [from_rows[l], I), and the combine adds the two partial sums.

Split by stage (optional): a pair mirrored with slot -3 has its expert's down projection (W2)
copied to the GPU while the host computes its activations first (``act`` [P, I], at the pair's
index), publishes them (``act_flag[l] = e``, stored for every layer, before the layer's other CPU
pairs) and writes a zero row for it; the device waits for the flag, runs the down projection
(``kernels/triton/stage.py``) and the combine adds it to that zero row.

Buffers (``CpuBranch``): ``flag``, ``done``, ``from_rows`` [L] int64; ``pair_slot``, ``pair_exp`` [L, P] int64;
``x`` [L, T, H] (the layer inputs); ``rows`` [P, H], in the model's dtype (bf16 or fp32), for at
most T = ``max_tokens`` tokens (a step may have fewer); pinned when CUDA is present.
On the device: ``epoch`` and ``err`` [1] int64. Steps are numbered from 1 in lock step:
every ``bump(epoch)`` on the device is matched by exactly one ``run()`` on the host.
"""
from __future__ import annotations

import ctypes

import torch

from .cpu.expert_args import values
from .cpu_experts import _load

_i64, _vp = ctypes.c_int64, ctypes.c_void_p
#: pairs a step's layer may have (branch.cpp's per-layer arrays)
MAX_PAIRS = 1024


class StepCancelled(RuntimeError):
    """``run`` returned because ``cancel()`` abandoned its step."""


class _FtBranch(ctypes.Structure):   # FtBranch in kernels/cpu/branch.cpp, field for field
    _fields_ = [("L", _i64), ("P", _i64), ("T", _i64), ("H", _i64), ("I", _i64), ("E", _i64),
                ("flag", _vp), ("done", _vp), ("cancel", _vp), ("pair_slot", _vp), ("pair_exp", _vp), ("ps_ls", _i64),
                ("pair_tok", _vp), ("x", _vp), ("x_ls", _i64), ("x_bf16", ctypes.c_int),
                ("w_bf16", ctypes.c_int), ("w13", _vp), ("w2", _vp),
                ("w13_ls", _i64), ("w13_es", _i64), ("w13_rs", _i64), ("w2_ls", _i64), ("w2_es", _i64),
                ("w2_rs", _i64), ("rows", _vp), ("timeout_s", ctypes.c_double),
                ("wait_s", ctypes.c_double), ("compute_s", ctypes.c_double),
                ("cpu_layers", _i64), ("cpu_pairs", _i64), ("failed_layer", _i64),
                ("from_rows", _vp), ("rows_tmp", _vp), ("streamed_rows", _i64),
                ("act", _vp), ("act_flag", _vp), ("act_tmp", _vp), ("stage_pairs", _i64),
                ("gate_act", ctypes.c_int), ("alpha", ctypes.c_float), ("limit", ctypes.c_float), ("b13", _vp)]


_DTYPES = (torch.bfloat16, torch.float32)


class CpuBranch:
    """Host buffers and the host loop of the handshake (see the module docstring).

    bank_w13 [L, E, 2I, H] and bank_w2 [L, E, H, I]: bf16 or fp32 host tensors with unit last
    stride (the expert bank); a step has up to ``max_tokens`` tokens of ``top_k`` pairs each, in
    token-major order as the control step's; ``dtype``: the layer inputs' and rows' dtype
    (default: the bank's). ``device``: where ``epoch`` / ``err`` live.
    """

    def __init__(self, bank_w13: torch.Tensor, bank_w2: torch.Tensor, max_tokens: int, top_k: int,
                 device: torch.device, timeout_s: float = 10.0, dtype: torch.dtype | None = None):
        lib = _load()
        if lib is None:
            raise RuntimeError("the CPU branch needs the compiled CPU kernel (kernels/cpu/build.py)")
        mx = bank_w13.dtype == torch.uint8                 # MXFP4 rows (kernels/mxfp4.py)
        dtype = dtype or (torch.bfloat16 if mx else bank_w13.dtype)
        if (bank_w13.dtype not in _DTYPES and not mx) or bank_w2.dtype != bank_w13.dtype or dtype not in _DTYPES:
            raise ValueError(f"bank and inputs must be bf16 or fp32 (the bank also MXFP4 rows), got {bank_w13.dtype} / "
                             f"{bank_w2.dtype} / {dtype}")
        if bank_w13.device.type != "cpu" or bank_w13.stride(-1) != 1 or bank_w2.stride(-1) != 1:
            raise ValueError("bank tensors must be host tensors with a unit stride in their last dim")
        L, E, two_i, H = bank_w13.shape
        if mx:
            H = values(bank_w13)
        P = max_tokens * top_k
        if P > MAX_PAIRS:
            raise ValueError(f"at most {MAX_PAIRS} pairs per call, got {max_tokens} x {top_k}")
        self._lib, self.device, self.top_k, self.max_tokens = lib, torch.device(device), top_k, max_tokens
        self.timeout_s = timeout_s
        pin = self.device.type == "cuda"

        def host(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self.flag, self.done, self.cancel_word = host(L), host(L), host(1)
        self.pair_slot, self.pair_exp = host(L, P), host(L, P)
        self.pair_tok = torch.arange(max_tokens).repeat_interleave(top_k)
        self.x = host(L, max_tokens, H, dtype=dtype)
        self.rows = host(P, H, dtype=dtype)
        self.from_rows = host(L)                       # streamed pairs' first CPU row, per layer
        self._rows_tmp = torch.empty(P, H, dtype=dtype)
        self.act, self.act_flag = host(P, two_i // 2, dtype=dtype), host(L)   # split by stage
        self._act_tmp = torch.empty(P, two_i // 2, dtype=dtype)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.err = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.host_epoch = 0
        self._bank = (bank_w13, bank_w2)
        s13, s2 = bank_w13.stride(), bank_w2.stride()
        bf = int(dtype == torch.bfloat16), 2 if mx else int(bank_w13.dtype == torch.bfloat16)
        self._c = _FtBranch(L, P, max_tokens, H, two_i // 2, E,
                            *(t.data_ptr() for t in (self.flag, self.done, self.cancel_word, self.pair_slot,
                                                     self.pair_exp)), P,
                            self.pair_tok.data_ptr(), self.x.data_ptr(), max_tokens * H, *bf,
                            bank_w13.data_ptr(), bank_w2.data_ptr(),
                            s13[0], s13[1], s13[2], s2[0], s2[1], s2[2], self.rows.data_ptr(), timeout_s,
                            0.0, 0.0, 0, 0, -1, self.from_rows.data_ptr(), self._rows_tmp.data_ptr(), 0,
                            self.act.data_ptr(), self.act_flag.data_ptr(), self._act_tmp.data_ptr(), 0,
                            0, 0.0, 0.0, None)
        self.totals = {"wait_s": 0.0, "compute_s": 0.0, "cpu_layers": 0, "cpu_pairs": 0, "streamed_rows": 0,
                       "stage_pairs": 0, "steps": 0}

    def set_gate(self, act, b13: torch.Tensor | None) -> None:
        """Experts of another kind (gpt-oss): ``act`` (a ``reference.GatedAct``) and the gate/up
        biases of every layer of the branch, ``b13 [L, E, 2I]`` (None: none), read as float32.
        Whole experts only: a step must then mark no streamed or staged pair."""
        from .cpu.gated import ACTS
        L, E, two_i = self.pair_slot.shape[0], self._c.E, 2 * self._c.I
        if b13 is not None and tuple(b13.shape) != (L, E, two_i):
            raise ValueError(f"b13 must be [{L}, {E}, {two_i}], got {tuple(b13.shape)}")
        self._b13 = None if b13 is None else b13.detach().float().cpu().contiguous()
        self._c.gate_act, self._c.alpha, self._c.limit = ACTS[act.kind], act.alpha, act.limit
        self._c.b13 = None if self._b13 is None else self._b13.data_ptr()

    def run(self, timeout_s: float | None = None, tokens: int | None = None) -> None:
        """The host half of the next step (blocks until its last layer's rows are published).
        ``timeout_s``: per-layer wait for this step (default: the constructor's; a first step
        that compiles kernels needs more); ``tokens``: the step's tokens (default: max_tokens).
        Raises RuntimeError when the device did not reach a layer in time or a pair is invalid."""
        tokens = self.max_tokens if tokens is None else tokens
        if not 0 < tokens <= self.max_tokens:
            raise ValueError(f"a step has 1..{self.max_tokens} tokens, got {tokens}")
        self.host_epoch += 1
        c = self._c
        c.T, c.P = tokens, tokens * self.top_k
        c.timeout_s = timeout_s or self.timeout_s
        rc = self._lib.ft_branch_run(ctypes.addressof(c), self.host_epoch)
        if rc == -3:
            raise StepCancelled(f"CPU branch: step {self.host_epoch} cancelled at layer {c.failed_layer}")
        if rc == -2:
            raise RuntimeError(f"CPU branch: the device did not publish layer {c.failed_layer} of step "
                               f"{self.host_epoch} within {c.timeout_s} s")
        if rc != 0:
            raise RuntimeError(f"CPU branch, layer {c.failed_layer}: {self._lib.ft_last_error().decode()}")
        for name in ("wait_s", "compute_s", "cpu_layers", "cpu_pairs", "streamed_rows", "stage_pairs"):
            self.totals[name] += getattr(c, name)
        self.totals["steps"] += 1

    def cancel(self, epoch: int | None = None) -> None:
        """Abandon step ``epoch`` (default: the one the host loop runs) because its caller stopped
        launching layers: the loop returns with ``StepCancelled`` instead of waiting for its
        timeout, also when it only starts that step later."""
        self.cancel_word[0] = self.host_epoch if epoch is None else epoch

    def check(self) -> None:
        """After a sync: raise RuntimeError if a device ``wait`` timed out (that step is invalid)."""
        bad = int(self.err.item())
        if bad:
            raise RuntimeError(f"CPU branch: the device stopped waiting for the host in step {bad}")
