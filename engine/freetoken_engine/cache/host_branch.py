"""The engine's decode-time CPU branch without a host sync per layer.

With the q* split some misses of every MoE layer are computed on the CPU. Done naively the
scheduler thread waits for each layer's control step, reads the pair slots back, computes the
CPU pairs and copies their rows up: one device-to-host sync per MoE layer. ``HostBranch`` uses
the handshake of ``kernels/cpu_branch.py`` instead: the scheduler thread only queues kernels
(control step with host mirrors, a signal, the GPU experts, a bounded device-side wait, the
merge), and a worker thread runs the C++ host loop that answers each layer as its flag arrives.
A decode step then has no sync until its sampler reads the tokens.

One step is one pass over the MoE layers in order (layer 0 starts it); every decode-sized call
of a step goes through here or none does. A step abandoned half-way (an exception between
layers) is cancelled when the next one begins, so the host loop never waits for its timeout.

Under CUDA-graph capture (``capturing``, set by ``executor/graphs.py``) only the device work is
recorded, the epoch bump included; each replay is then preceded by ``start_replay(tokens)``,
which starts the host loop for the step the graph is about to run.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..kernels.cpu_branch import CpuBranch, StepCancelled
from ..kernels.reference import SplitRows
from ..kernels.triton import handshake
from .bank import ExpertBank


class HostBranch:
    """For an ``ExpertBank`` on the host and a cache on ``device``; steps of up to ``max_tokens``
    tokens with ``top_k`` experts each. Raises RuntimeError / ValueError when the compiled CPU
    kernel is missing or the shapes are unsupported (the caller then keeps its synchronous path)."""

    #: Queue a layer's fill copies after the signal that starts the host's experts, so PCIe and
    #: the CPU work at once. False: the order before 2026-11-29 (copies first, so the host waited
    #: for PCIe before computing), kept only for the A/B rows of bench/engine_gpu_decode.py.
    copy_after_signal = True

    def __init__(self, bank: ExpertBank, top_k: int, max_tokens: int, device: torch.device,
                 dtype: torch.dtype, timeout_s: float = 120.0, layers: int | None = None, first: int = 0):
        """``first``, ``layers``: the bank's layers a step runs, in order (default all). A decode
        step runs the model's layers; an MTP layer (the bank's last) runs in passes of its own,
        with a branch of its own (``first`` = the model's MoE layer count, one layer)."""
        n = bank.w13.shape[0] - first if layers is None else layers
        self.br = CpuBranch(bank.w13[first:first + n], bank.w2[first:first + n], max_tokens, top_k, device,
                            timeout_s=timeout_s, dtype=dtype)
        self.first = first
        self.layers = n
        self.counts = torch.zeros(self.layers, 4, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="freetoken-cpu-branch")
        self._pending: Future | None = None
        self._first = True
        self._queued = 0              # layers of the current step queued so far
        self._steps = 0               # steps started (the device epoch after their bump)
        self.capturing = False        # recording a CUDA graph: queue device work only

    def finish(self) -> None:
        """Wait for the running step's host loop (at a safe point or before the next step);
        cancel it if the step stopped before queuing its last layer. Raises the loop's error.

        A step whose every layer was queued is in flight, not abandoned, even when the device
        has not reached its last layers yet (kernels run asynchronously): its loop must answer
        them, so it is waited for. (Cancelling on "last flag not yet set" was the bug the H200
        found: every step that finished queuing before the device finished running it lost its
        remaining layers, and the device waited for them until its timeout.)"""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if self._queued < self.layers:
            self.br.cancel(self._steps)
        try:
            pending.result()
        except StepCancelled:
            pass
        self.br.check()

    def layer(self, control, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, pair_tok: torch.Tensor,
              beside=None, guess=None, math: dict | None = None) -> tuple[SplitRows, object]:
        """Queue MoE layer ``layer`` of the current step; returns its pair rows (``SplitRows``:
        the device's rows, the host's compact rows in pinned memory; valid in stream order) and
        ``beside()`` (device work run beside the hits, ``DeviceControl.run_experts``, which also
        prefetches ``guess``: the next layer's guessed experts). ``math``: the device's expert
        calls' arguments for experts of another kind (``run_experts``'; the host's are the
        branch's own, ``CpuBranch.set_gate``)."""
        br = self.br
        t, k = topk_ids.shape
        p = t * k
        i = layer - self.first                # the branch's own index of the bank's layer
        if i == 0:
            if self.capturing:
                handshake.bump(br.epoch)
            else:
                self._start(t, bump=True)
        mirror = (br.pair_slot[i, :p], self.counts[i], br.pair_exp[i, :p])
        if control.stream is not None:
            mirror += (br.from_rows[i:i + 1],)
        out = control.step(layer, topk_ids, copy=not self.copy_after_signal, mirror=mirror)
        handshake.signal(br.flag[i:i + 1], br.epoch, src=x.contiguous(), dst=br.x[i, :t])
        # The copies only after the signal: the host starts its experts while the fills cross PCIe,
        # the hits run beside the copies and the filled experts after them (CPU pairs' rows unset).
        gpu, extra = control.run_experts(layer, x, pair_tok, out, beside, copy=self.copy_after_signal, guess=guess,
                                         math=math)
        part = control.streamed_forward(x, pair_tok, out)     # the streamed split's GPU part, or None
        if control.stream is not None and control.stream.stage:
            # the split by stage: the host publishes the activations before its other CPU pairs
            handshake.wait(br.act_flag[i:i + 1], br.epoch, br.err)
            part = control.stage_forward(br.act, out)
        handshake.wait(br.done[i:i + 1], br.epoch, br.err)
        self._queued = i + 1
        # The combine reads the host's rows straight from pinned memory (kernels/triton/combine.py):
        # nothing more between the wait and the next layer.
        return SplitRows(gpu, out.pair_slot[:p], br.rows, part), extra

    def _start(self, tokens: int, bump: bool) -> None:
        self.finish()
        self._queued = 0
        if bump:
            handshake.bump(self.br.epoch)
        self._steps += 1
        # the first step compiles kernels while the loop waits: give it longer
        self._pending = self._pool.submit(self.br.run, 300.0 if self._first else None, tokens)
        self._first = False

    def start_replay(self, tokens: int) -> None:
        """Before replaying a graph captured over a whole step of ``tokens`` tokens: start the
        host loop that answers it (the graph bumps the epoch and queues every layer itself)."""
        self._start(tokens, bump=False)
        self._queued = self.layers

    def close(self) -> None:
        self.finish()
        self._pool.shutdown(wait=True)
