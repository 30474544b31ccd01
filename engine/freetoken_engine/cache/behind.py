"""Fills behind the CPU for ``DeviceControl`` (kernels and rules: ``kernels/triton/behind.py``).

``FillBehind`` keeps one background copy's state on the device and queues, after each decode
call's fill gather, the plan and the slice copy. It owns the reserved slot's bookkeeping: any
other writer of the pool's residency (a seed, a prefill's fills into empty slots, a write-back
to the host cache, a rebind after a resize) first calls ``abandon``, which releases the slot in
stream order without a host sync.
"""
from __future__ import annotations

import torch

from ..kernels.triton.behind import SAFETY, behind_copy, behind_plan, cpu_time_table, expert_words, new_state


class FillBehind:
    """One background copy of a ``DeviceControl``'s pool (see the module docstring). It keeps no
    reference to the control (whose pool may be gigabytes: a cycle would outlive the caller's
    last reference until a garbage collection); each method is handed it."""

    def __init__(self, ctl, safety: float = SAFETY) -> None:
        if not 0.0 < safety <= 1.0:
            raise ValueError(f"fill-behind safety must be in (0, 1], got {safety}")
        self.safety = safety
        self.words = expert_words(ctl.bank_w13, ctl.bank_w2)
        self.state = new_state(ctl.device)
        self.rates_changed(ctl)

    def rates_changed(self, ctl) -> None:
        """Rebuild the CPU-time table after a change of q* or the CPU's call-size curve."""
        self.cpu_time = cpu_time_table(ctl.fill_fraction, ctl.slot_of.shape[1], ctl.device, ctl.cpu_speed)

    def after_fills(self, ctl, layer: int, out) -> None:
        """Queue the plan and the slice copy of the call whose control step wrote ``out`` (after
        its fill gather, on the same stream). A call of as many pairs as the pool has slots
        plans nothing: the control step could then need the reserved slot as a victim."""
        if out.pair_slot.numel() >= ctl.slot_owner.numel():
            return
        behind_plan(self.state, layer, out.step_counts, out.cpu_exp, self.cpu_time, ctl.slot_of, ctl.slot_owner,
                    ctl.last_used, ctl.clock, self.words, self.safety, ctl.max_slots, ctl.window)
        behind_copy(ctl.bank_w13, ctl.bank_w2, ctl.w13_slots, ctl.w2_slots, self.state)

    def abandon(self, ctl) -> None:
        """Drop the copy in flight, if any: its reserved slot becomes empty (``last_used`` -1).
        In stream order, no host sync."""
        slot = self.state[1:2].clamp(0, ctl.slot_owner.numel() - 1)
        reserved = (self.state[0:1] >= 0) & (ctl.slot_owner.index_select(0, slot) < 0)
        ctl.last_used.index_copy_(0, slot, torch.where(reserved, -1, ctl.last_used.index_select(0, slot)))
        self.state[:4].copy_(new_state(ctl.device)[:4])      # the counters go on

    def counters(self) -> dict[str, int]:
        """One sync: the copy in flight (owner = layer * E + expert, -1 when idle; its slot; the
        words of ``words`` it has copied) and, since construction, the words copied behind the
        CPU and the experts they made resident."""
        owner, slot, _, done, copied, resident = (int(v) for v in self.state.tolist())
        return {"owner": owner, "slot": slot, "done": done if owner >= 0 else 0, "words": self.words,
                "copied_words": copied, "made_resident": resident}
