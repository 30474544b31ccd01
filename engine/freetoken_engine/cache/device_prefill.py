"""A prefill's fills of ``DeviceControl``'s pool, device to device from a whole-layer buffer:
``seed`` (the prompt's routed experts, by the control step's own victims) and ``fill_free`` (the
empty slots). A mixin: the state (pool, residency, clock, tables) is ``DeviceControl``'s.
"""
from __future__ import annotations

import torch

from ..kernels.triton.control_outputs import fill_table
from ..kernels.triton.gather import gather_fill_rows


class PrefillFills:
    """``DeviceControl``'s prefill-side fills (see the module docstring)."""

    def seed(self, layer: int, topk_ids: torch.Tensor, src_w13: torch.Tensor, src_w2: torch.Tensor) -> int:
        """Make the experts of ``topk_ids [T, k]`` in ``layer`` resident, copied from ``src_w13
        [E, 2I, H]`` / ``src_w2 [E, H, I]`` on the pool's device (a prefill's whole-layer buffer)
        instead of over PCIe: a control step that fills every miss it may (LRU victims, never one
        of these experts, and with fill admission on never a slot used within its window, so a
        running decode keeps its experts), whose copies run device to device. The counters are
        left as they were (a seed is not a decode miss). Returns how many experts were copied
        (one host sync)."""
        if self._seed_table is None:
            self._seed_table = fill_table(1.0, self.slot_of.shape[1], self.device)
        # Each control step advances the clock, the seeds' too; the admission window is widened
        # by the seeds run since the last other step, so it still spans that many decode layer
        # calls (graph replays step without Python, hence the clock tells whether one came between).
        now = self.host_clock()
        if now != self._seed_clock + 1:
            self._seed_run = 0
        window = self.admit_window + self._seed_run if self.admit_window > 0 else 0
        saved = self.totals.clone()
        out = self._control(layer, topk_ids, self._seed_table, window)
        self.totals.copy_(saved)
        self._seed_clock, self._seed_run = now, self._seed_run + 1
        filled = out.fill_slot >= 0
        slots, experts = out.fill_slot[filled], out.fill_exp[filled]
        gather_fill_rows(src_w13[None], src_w2[None], self.w13_slots, self.w2_slots, 0, experts, slots)
        return int(slots.numel())

    def fill_free(self, layer: int, topk_ids: torch.Tensor, src_w13: torch.Tensor, src_w2: torch.Tensor) -> int:
        """A prefill fills the pool's empty slots with ``layer``'s experts from its whole-layer
        buffer (``src_w13 [E, 2I, H]`` / ``src_w2 [E, H, I]``, holding at least every expert the
        pool lacks), device to device: up to ``lru slots // layers`` resident experts a layer (the
        whole layer when every expert fits), the most routed in ``topk_ids [T, k]`` first. Nothing
        is evicted. An empty pool (a start, a resize that grew it) is thus full after the first
        long prompt, and the next prompts stream only what it cannot hold. The slots keep
        ``last_used`` -1 (never used by a step): a decode fill or a seed takes them before any slot
        a step used, and admission never protects them; a decode hit gives them a clock. The clock
        does not move. Residency only: no output changes. Returns how many experts were copied
        (one host sync while empty slots remain; none after)."""
        if self._full or self._host_state:
            return 0
        n_layers, n_exp = self.slot_of.shape
        lru = self.slot_owner.numel()
        share = n_exp if lru >= n_layers * n_exp else lru // n_layers
        absent = self.slot_of[layer] < 0
        empty, missing = torch.stack([(self.slot_owner < 0).sum(), absent.sum()]).tolist()
        if empty == 0:
            self._full = True
            return 0
        n = min(empty, missing, share - (n_exp - missing))
        if n <= 0:
            return 0
        routed = torch.bincount(topk_ids.reshape(-1), minlength=n_exp)
        experts = torch.argsort(torch.where(absent, routed, -1), descending=True, stable=True)[:n]
        slots = torch.argsort(self.slot_owner, stable=True)[:n]       # the empty slots (-1) first
        # one gather launch, device to device, with no temporary (an indexed copy would first
        # hold the n experts again: 1.2 GB for a whole Qwen3-30B layer)
        gather_fill_rows(src_w13[None], src_w2[None], self.w13_slots, self.w2_slots, 0, experts, slots)
        self.slot_of[layer, experts] = slots
        self.slot_owner[slots] = layer * n_exp + experts
        return n
