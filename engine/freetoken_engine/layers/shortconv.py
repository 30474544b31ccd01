"""The gated short convolution: LFM2's recurrent token mixer.

``in_proj`` gives three vectors of the hidden size per token, B, C and x; B * x passes a causal
depthwise convolution of width K (no activation), whose last K - 1 inputs are the layer's whole
recurrent state; C gates its output, and ``out_proj`` projects it::

    y_t = C_t * sum_j w_j (B x)_{t - K + 1 + j};   out_t = W_out y_t

A sequence's state lives in a slot of the ``StatePool`` (``cache/states.py``; its ``ssm`` part is
empty for this mixer) as the Gated DeltaNet's does, with the same contract (``layers/deltanet.py``):
``AttnBatch.state_slots`` names each sequence's slot, a pass from position 0 starts from zeros,
``AttnBatch.snapshots`` asks for copies of the state after given positions, a captured decode
step reads ``state_index`` only. It runs on torch's ops everywhere; chained decode rows (a draft's
verification) run on the CPU only.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import LinearAttnConfig
from .deltanet import depthwise_conv, each_sequence
from .linear import linear


class ShortConv(nn.Module):
    def __init__(self, hidden: int, lin: LinearAttnConfig, state_index: int):
        super().__init__()
        bias = lin.bias
        self.hidden, self.state_index, self.width = hidden, state_index, lin.conv
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.conv = nn.Conv1d(hidden, hidden, lin.conv, groups=hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)
        self.conv_w: torch.Tensor | None = None
        self.states = None                     # the StatePool, attached by the runner

    def fuse(self) -> None:
        self.conv_w = self.conv.weight[:, 0, :].contiguous()               # [C, K]

    def chains(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Chained decode rows (``AttnBatch.state_chain``) run eagerly on the CPU; a GPU step that
        chains them would need a kernel that reads them in a captured step."""
        return device.type != "cuda"

    def _convolve(self, seq: torch.Tensor) -> torch.Tensor:
        """``seq [B, n + K - 1, C]`` (the K - 1 inputs before, then n new ones) -> ``[B, n, C]``."""
        return depthwise_conv(seq, self.conv.weight[:, 0, :] if self.conv_w is None else self.conv_w, self.conv.bias)

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        conv = self.states.conv[self.state_index]
        b, c, v = linear(x, self.in_proj.weight, self.in_proj.bias).chunk(3, dim=-1)
        bx = b * v
        y = torch.empty_like(bx)
        each_sequence(
            batch, x.device, y, "chained decode rows need the CPU in a short-convolution model",
            chunk=lambda i, at, n: self._chunk(bx[at:at + n], batch.state_slots[i], batch.fresh(i), batch.snaps(i),
                                               conv),
            singles=lambda rows, slots, seqs, out_slots=None: self._singles(rows, slots, seqs, bx, batch, conv, y,
                                                                          out_slots))
        return linear(c * y, self.out_proj.weight, self.out_proj.bias)

    def _chunk(self, bx: torch.Tensor, slot: int, fresh: bool, snaps, conv: torch.Tensor) -> torch.Tensor:
        """A prompt's chunk of one sequence; ``snaps``: (offset in the chunk, checkpoint slot) to
        copy the state after."""
        past = conv[slot].zero_() if fresh else conv[slot]
        seq = torch.cat((past.to(bx.dtype), bx))                           # [n + K - 1, C]
        width = self.width - 1
        for end, ck in snaps:
            conv[ck].copy_(seq[end:end + width])
        conv[slot].copy_(seq[seq.shape[0] - width:])
        return self._convolve(seq[None])[0]

    def _singles(self, rows, slots, seqs, bx, batch, conv, y, out_slots=None) -> None:
        """One token of each of several sequences, together: ``rows`` of the pass (None: all)
        whose states are in ``slots`` (device tensors; written back there, or to ``out_slots``);
        ``seqs``: their sequences' indices in the batch (empty in a captured step)."""
        past = conv.index_select(0, slots)
        fresh = [j for j, i in enumerate(seqs) if batch.fresh(i)]
        if fresh:
            past[fresh] = 0
        m = bx if rows is None else bx.index_select(0, rows)                 # [B, C]
        seq = torch.cat((past.to(m.dtype), m[:, None]), 1)                   # [B, K, C]
        out = self._convolve(seq)[:, 0]
        if rows is None:
            y.copy_(out)
        else:
            y.index_copy_(0, rows, out)
        conv.index_copy_(0, slots if out_slots is None else out_slots, seq[:, 1:])
        for j, i in enumerate(seqs):
            for _, ck in batch.snaps(i):
                conv[ck].copy_(seq[j, 1:])
