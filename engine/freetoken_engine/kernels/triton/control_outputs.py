"""The control step's fixed-size outputs and its options, apart from its kernel (``control.py``):
``ControlOutputs`` (device tensors a caller allocates once per pair count and reuses, so CUDA
graphs see stable addresses), ``StreamSplit`` (the streamed split and the split by stage) and
``fill_table`` (q before the slot cap, per miss count). Nothing here needs Triton.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..split import fills_for
from ._common import next_pow2

#: the order of ``step_counts`` and of a caller's ``totals``
COUNTERS = ("hits", "misses", "fills", "cpu_computed")


@dataclass
class ControlOutputs:
    """Fixed-size outputs of one control step (device tensors, reused across calls).

    pair_slot [P]: slot per pair, -1 = CPU pair; pair_hit_slot / pair_fill_slot [P]: the same
    split by whether the expert was resident before the step (a hit) or is filled by it, -1
    elsewhere, so the hits can be computed while the fills are still being copied.
    fill_exp / fill_slot [NF]: the step's fills in the
    misses' order (step 3) and their victim slots, -1 padded. cpu_exp [NF]: experts computed on the
    CPU, in that order, -1 padded. step_counts [4]: hits, misses, fills, cpu_computed of the call.
    NF = min(P, E) bounds the distinct experts of a call. With a streamed split (``stream=``):
    pair_stream [P]: the scratch slot (the CPU rank of its expert, < NS) of each pair whose rows
    [0, stream_rows) the GPU computes from a streamed copy, -1 elsewhere; stream_rows [1].
    keys / newslot / cpurank are workspace.
    """

    pair_slot: torch.Tensor
    pair_hit_slot: torch.Tensor
    pair_fill_slot: torch.Tensor
    fill_exp: torch.Tensor
    fill_slot: torch.Tensor
    cpu_exp: torch.Tensor
    step_counts: torch.Tensor
    keys: torch.Tensor
    newslot: torch.Tensor
    pair_stream: torch.Tensor
    stream_rows: torch.Tensor
    cpurank: torch.Tensor

    @classmethod
    def allocate(cls, pairs: int, experts: int, slots: int, device: torch.device) -> "ControlOutputs":
        nf = min(pairs, experts)

        def full(n: int) -> torch.Tensor:
            return torch.full((n,), -1, dtype=torch.int64, device=device)

        return cls(full(pairs), full(pairs), full(pairs), full(nf), full(nf), full(nf),
                   torch.zeros(4, dtype=torch.int64, device=device),
                   full(next_pow2(slots)), full(next_pow2(experts)), full(pairs),
                   torch.zeros(1, dtype=torch.int64, device=device), full(next_pow2(experts)))

    @classmethod
    def reused(cls, store: dict[int, "ControlOutputs"], pairs: int, experts: int, slots: int,
               device: torch.device) -> "ControlOutputs":
        """``store[pairs]``, allocated on first use: one set of buffers per call size."""
        if pairs not in store:
            store[pairs] = cls.allocate(pairs, experts, slots, device)
        return store[pairs]


@dataclass(frozen=True)
class StreamSplit:
    """The streamed split of a control step: of the first ``max_streamed`` CPU experts, the
    intermediate rows [0, rows) are also copied to the GPU (``stream.py``) and computed there, the
    CPU computes rows [rows, I); rows is a multiple of ``granule`` in [0, I - granule] that
    balances PCIe against the CPU for the layer's fills at PCIe share ``share`` (q*/m).
    ``stage``: the split by stage instead: of the CPU experts, the first n (at most
    ``max_streamed``) have their whole W2 copied and their down projection run on the GPU from the
    host's activations (``stage.py``); n balances PCIe against the CPU the same way; pairs
    mirrored -3; ``stream_rows`` holds n. Only in calls of at most ``stage_tokens`` tokens: with
    more, a staged expert's first stage is a second CPU kernel call a layer, which on an AMX CPU
    runs without the tiles (H200 run 38: batch 4 0.79x)."""

    share: float
    inter: int
    granule: int = 64
    max_streamed: int = 8
    stage: bool = False          # split by stage instead: whole W2 of n CPU experts (see the kernel)
    stage_tokens: int = 1

    def check(self) -> None:
        rows_ok = self.stage or (self.granule >= 1 and not self.inter % self.granule
                                 and self.inter >= 2 * self.granule)     # the split by stage has no rows
        if not 0.0 <= self.share <= 1.0 or not rows_ok or self.max_streamed < 1 or self.stage_tokens < 1:
            raise ValueError(f"bad stream split {self}: need 0 <= share <= 1, I a multiple of the granule "
                             f"and at least two granules, max_streamed >= 1, stage_tokens >= 1")

    def args(self, tokens: int) -> tuple:
        """The kernel's (share, INTER, GRANULE, NS) for a call of ``tokens`` tokens: NS = 0 (nothing
        staged) in a split by stage over more than ``stage_tokens`` tokens."""
        ns = 0 if self.stage and tokens > self.stage_tokens else self.max_streamed
        return float(self.share), self.inter, self.granule, ns


def fill_table(fill_fraction: float, experts: int, device: torch.device, floor: bool = False,
               speed: Sequence[float] | None = None) -> torch.Tensor:
    """``[E + 1]`` int32: q before the slot cap for each miss count m, rounded on the host
    (``floor``: floor(f m), the streamed split's rule; ``speed``: the CPU's call-size curve; see
    ``kernels/split.py``)."""
    return torch.tensor([fills_for(m, fill_fraction, floor, speed) for m in range(experts + 1)],
                        dtype=torch.int32, device=device)
