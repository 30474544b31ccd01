"""Fills behind the CPU for ``DeviceControl`` (kernels and rules: ``kernels/triton/behind.py``).

``FillBehind`` keeps one background copy's state and its staging row (one expert) on the device
and queues, after each decode call's fill gather, the plan and the copy. The residency changes
only inside the plan, in stream order with the control steps, so the other writers of it need not
know of the copy; a graph warm-up's steps (``DeviceControl.all_resident``) pause it.
"""
from __future__ import annotations

import torch

from ..kernels.triton.behind import (COPIED, HI, OWNER, RESIDENT, SAFETY, behind_copy, behind_plan,
                                     cpu_time_table, expert_words, new_state)


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
        self.staging = (torch.empty(ctl.w13_slots.shape[1:], dtype=ctl.w13_slots.dtype, device=ctl.device),
                        torch.empty(ctl.w2_slots.shape[1:], dtype=ctl.w2_slots.dtype, device=ctl.device))
        self.rates_changed(ctl)

    def rates_changed(self, ctl) -> None:
        """Rebuild the CPU-time table after a change of q* or the CPU's call-size curve."""
        self.cpu_time = cpu_time_table(ctl.fill_fraction, ctl.slot_of.shape[1], ctl.device, ctl.cpu_speed)

    def after_fills(self, ctl, layer: int, out) -> None:
        """Queue the plan and the copy of the call whose control step wrote ``out`` (after its fill
        gather, on the same stream)."""
        behind_plan(self.state, layer, out.step_counts, out.cpu_exp, self.cpu_time, ctl.slot_of, ctl.slot_owner,
                    ctl.last_used, ctl.clock, self.words, self.safety, ctl.max_slots, ctl.window)
        behind_copy(ctl.bank_w13, ctl.bank_w2, self.staging, ctl.w13_slots, ctl.w2_slots, self.state)

    def pause(self) -> None:
        """Drop the copy in flight (its staged words are forgotten); the counters go on. In stream
        order, no host sync."""
        self.state[OWNER] = -1

    def counters(self) -> dict[str, int]:
        """One sync: the copy in flight (owner = layer * E + expert, -1 when idle; the words of
        ``words`` it has staged) and, since construction, the words copied behind the CPU and the
        experts they made resident."""
        st = self.state.tolist()
        return {"owner": st[OWNER], "done": st[HI] if st[OWNER] >= 0 else 0, "words": self.words,
                "copied_words": st[COPIED], "made_resident": st[RESIDENT]}
