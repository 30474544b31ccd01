"""The expert cache's decode control step run on the device: no host sync, graph-capturable.

``DeviceControl`` holds device views of the cache's state (slot pools, ``slot_of``,
``slot_owner``, ``last_used``; ``ExpertCache`` names the pool ``w13`` / ``w2``) plus a device clock and device counters, and runs, per MoE layer
and decode step:

    control_step (Triton, one program)  ->  gather_fill_rows (Triton, one launch)  ->  caller's MoE

The control step is exact against the cache's torch step (same fills, victims, residency,
clocks, pair slots, counters). Nothing here reads a device value on the host, so a whole decode
step of fills-only layers can be captured in a CUDA graph; the host learns counts only through
``counters()`` / ``host_clock()`` (each one sync, for stats and safe points).

Ownership: the tensors are the cache's own when they already live on the device (mutated in
place); otherwise device mirrors are made and ``write_back()`` copies them into the cache at a
safe point. After ``ExpertCache.resize`` call ``refresh(cache)``: the pools and residency are
new tensors and every ``ControlOutputs`` sized for the old pool is dropped.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from ..kernels.split import check_speed
from ..kernels.triton.control import control_step
from ..kernels.triton.control_outputs import COUNTERS, ControlOutputs, StreamSplit, fill_table
from ..kernels.triton.gather import gather_fill_rows
from ..kernels.triton.stage import stage_down_forward
from ..kernels.triton.moe import moe_slots_forward
from ..kernels.triton.stream import stream_rows_copy
from ..kernels.triton.behind import SAFETY as BEHIND_SAFETY
from .behind import FillBehind
from .device_prefill import PrefillFills
from .experts import admission_window
from .guess import GuessedFills


class DeviceControl(PrefillFills):
    """Device-side control of one expert cache (see the module docstring). Not thread-safe: the
    engine's scheduler thread is its only user."""

    #: ``run_experts``: compute a layer's hits on a side stream while its fills are copied,
    #: then the filled experts. False: every pair in one call after the copies (the engine before
    #: 2026-11-30; the A/B side ``graphs/serial-hits`` of bench/engine_gpu_decode.py).
    overlap_hits = True

    def __init__(self, bank_w13: torch.Tensor, bank_w2: torch.Tensor, w13_slots: torch.Tensor,
                 w2_slots: torch.Tensor, slot_of: torch.Tensor, slot_owner: torch.Tensor,
                 last_used: torch.Tensor, clock: int, fill_fraction: float,
                 max_slots: int | None = None, admit_window: int = 0, recur_window: int = 0,
                 last_active: torch.Tensor | None = None, cpu_speed=None) -> None:
        self.device = w13_slots.device
        self.cpu_speed = check_speed(cpu_speed)   # the CPU's call-size curve (kernels/split.py)
        self.max_slots = max_slots    # the largest pool a resize may bind: one compiled kernel for all
        self.bank_w13, self.bank_w2 = bank_w13, bank_w2
        self.totals = torch.zeros(4, dtype=torch.int64, device=self.device)
        self.stream: StreamSplit | None = None
        self.scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self.floor_fills = False
        self.admit_window = admit_window   # fill admission (cache/experts.py), used while fill_fraction < 1
        self.recur_window = recur_window   # recurring misses first (cache/experts.py), likewise
        if last_active is None:
            last_active = torch.full(slot_of.shape, -1, dtype=torch.int64)
        self._seed_table: torch.Tensor | None = None   # fill every miss (seed)
        self._seed_clock, self._seed_run = -2, 0         # the last seed's clock; seeds in a row
        self.guessed = GuessedFills(self.device)        # ``prefetch``'s outputs, counters and copies
        self.behind: FillBehind | None = None           # fills behind the CPU (``set_behind``)
        self._bind(w13_slots, w2_slots, slot_of, slot_owner, last_used, clock, last_active)
        self.set_fill_fraction(fill_fraction)
        # made here, not at first use: a decode graph's capture may be the first use
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @classmethod
    def from_cache(cls, cache, resizable: bool = False) -> "DeviceControl":
        """Bind to an ``ExpertCache`` (its pool ``w13`` / ``w2``, residency, ``clock``,
        ``fill_fraction`` and ``bank``) at a safe point. ``resizable``: the pool may later be
        resized to any size up to all experts (the engine's case), so the control kernel is
        compiled once for that maximum instead of again after each resize."""
        return cls(cache.bank.w13, cache.bank.w2, cache.w13, cache.w2, cache.slot_of, cache.slot_owner,
                   cache.last_used, int(cache.clock), float(cache.fill_fraction),
                   max_slots=cache.bank.total_experts if resizable else None,
                   admit_window=cache.admit_window, recur_window=cache.recur_window, last_active=cache.last_active,
                   cpu_speed=cache.cpu_speed)

    def _bind(self, w13_slots, w2_slots, slot_of, slot_owner, last_used, clock: int, last_active) -> None:
        dev = self.device = w13_slots.device
        self.w13_slots, self.w2_slots = w13_slots, w2_slots
        # pool rows past the LRU's slots: bypass slots for refused fills (cache/experts.py); none
        # for a pool smaller than the LRU (a timing of the control step alone, which copies nothing)
        self.bypass = max(0, min(w13_slots.shape[0], w2_slots.shape[0]) - slot_owner.numel())
        self._host_state = slot_of.device != dev
        self.slot_of = slot_of.to(dev).contiguous()
        self.slot_owner = slot_owner.to(dev, torch.int64).contiguous()
        self.last_used = last_used.to(dev, torch.int64).contiguous()
        self.last_active = last_active.to(dev, torch.int64).contiguous()
        self.clock = torch.tensor([clock], dtype=torch.int64, device=dev)
        self._outputs: dict[int, ControlOutputs] = {}
        self.guessed.reset()       # its outputs were sized for the old pool
        self._full = False         # no empty slot left (fill_free): set once seen, until a rebind

    def refresh(self, cache) -> None:
        """Re-read the cache's tensors after a resize (call at the same safe point)."""
        self.bank_w13, self.bank_w2 = cache.bank.w13, cache.bank.w2     # pinning may have replaced them
        self._bind(cache.w13, cache.w2, cache.slot_of, cache.slot_owner, cache.last_used, int(cache.clock),
                   self.last_active)       # the routing history outlives the pool
        self.cpu_speed = check_speed(cache.cpu_speed)
        self.set_fill_fraction(float(cache.fill_fraction))

    def write_back(self, cache) -> None:
        """At a safe point: hand the device clock and the counters since the last write-back to
        the cache (``cache.clock``, ``cache.stats``), and copy device mirrors into a cache whose
        residency lives elsewhere. One sync. Call before ``cache.resize`` and before the cache's
        own ``step`` runs again."""
        for name in ("slot_of", "slot_owner", "last_used", "last_active"):
            dst = getattr(cache, name)
            if dst.data_ptr() != getattr(self, name).data_ptr():
                dst.copy_(getattr(self, name))
        cache.clock = self.host_clock()
        for name, value in self.counters().items():
            setattr(cache.stats, name, getattr(cache.stats, name) + value)
        self.totals.zero_()

    def set_fill_fraction(self, fill_fraction: float) -> None:
        """Set q*/m; the rounding table is built on the host (raises ValueError outside [0, 1])."""
        floor = self.stream is not None and self.floor_fills
        self.fill_table = fill_table(fill_fraction, self.slot_of.shape[1], self.device, floor, self.cpu_speed)
        self.fill_fraction = fill_fraction
        self.window = admission_window(self.admit_window, fill_fraction)
        self.recur = admission_window(self.recur_window, fill_fraction)
        if self.stream is not None:
            self.stream = dataclasses.replace(self.stream, share=fill_fraction)
        if self.behind is not None:
            self.behind.rates_changed(self)

    def set_behind(self, safety: float | None = BEHIND_SAFETY) -> None:
        """Fills behind the CPU (``cache/behind.py``) with slices of ``safety`` of each call's idle
        PCIe time (its staging row: one expert's bytes of device memory), or off (``None``; a
        copy in flight is dropped). Not with ``prefetch``."""
        self.behind = None if safety is None else FillBehind(self, safety)

    def set_stream(self, max_streamed: int | None, granule: int = 64, floor_fills: bool = False,
                   stage: bool = False) -> None:
        """Turn the streamed split on (``kernels/triton/stream.py``): of up to ``max_streamed``
        CPU experts per layer call, the first rows are copied to ``max_streamed`` device scratch
        slots (that many experts' bytes of device memory) and computed there, balancing PCIe
        against the CPU at the fill fraction; the cache's fills and residency do not change.
        ``floor_fills``: fill floor(f m) of m misses instead of the rounded q* rule, so that no
        layer waits for PCIe (``kernels/split.py``); fewer fills, a different cache.
        ``stage``: the split by stage instead (``StreamSplit.stage``): the GPU runs the down
        projection of up to ``max_streamed`` CPU experts a layer from their copied W2 and the
        host's activations (``stage_forward``), in 1-token calls. The fills stay the rounded q*
        rule unless ``floor_fills``, so the cache makes the same choices as without the split and
        only the layers whose PCIe finishes first (a balance that asks for n > 0) stage anything;
        with floor fills the miss rate rose (H200 run 38: 0.240 -> 0.278, 0.95x at batch 1).
        ``None``: off. Raises ValueError when the expert's intermediate size does not split into
        at least two granules."""
        if max_streamed is None:
            self.stream = self.scratch = None
            self.set_fill_fraction(self.fill_fraction)
            return
        inter = self.w2_slots.shape[2]
        split = StreamSplit(self.fill_fraction, inter, granule, max_streamed, stage)
        split.check()
        like = dict(dtype=self.w13_slots.dtype, device=self.device)
        self.scratch = (torch.zeros((max_streamed, *self.w13_slots.shape[1:]), **like),
                        torch.zeros((max_streamed, *self.w2_slots.shape[1:]), **like))
        self.stream, self.floor_fills = split, floor_fills
        self.set_fill_fraction(self.fill_fraction)

    def outputs(self, pairs: int) -> ControlOutputs:
        """The fixed output buffers for calls of ``pairs`` (T*k) pairs: stable addresses for graphs."""
        return ControlOutputs.reused(self._outputs, pairs, self.slot_of.shape[1], self.slot_owner.numel(),
                                     self.device)

    def step(self, layer: int, topk_ids: torch.Tensor, copy: bool = True,
             mirror: tuple[torch.Tensor, ...] | None = None, out: ControlOutputs | None = None) -> ControlOutputs:
        """Control step for ``layer`` on routed ``topk_ids [T, k]``, then (``copy``) the fills'
        weights into their slots. ``mirror`` (pinned host ``pair_slot [T*k]`` and ``counts [4]``,
        int64, and optionally ``pair_exp [T*k]``: the routed experts) also receives the pair slots
        and the step's counts, for a host-side CPU branch (``kernels/cpu_branch.py``). ``out``:
        output buffers of the caller's (``ControlOutputs.allocate``) instead of the shared ones,
        for a caller that runs a layer's step before the previous layer's outputs are used up.
        Returns the output buffers; no host sync.

        A layer with an outstanding ``prefetch`` (made during the layer before) counts the
        prefetch's fills against its PCIe share (``control_step(spent=)``): with right guesses
        the two fill together what the step alone would have, so the split keeps its balance;
        guesses that were resident already leave the step its own share. (With every miss filled,
        fill fraction 1, it fills the rest as usual.) The prefetch's copies may still be crossing
        PCIe: ``run_experts`` (or a caller that reads the slots otherwise, after
        ``wait_prefetched``) waits for them, so the step and its CPU branch start at once. A
        prefetch of another layer is waited for here."""
        spent = self.guessed.take(layer, self.fill_fraction < 1.0)
        out = self._control(layer, topk_ids, self.fill_table, self.window, mirror, self.stream, self.bypass, out,
                            spent)
        if copy:
            self.copy(layer, out)
        return out

    def _control(self, layer: int, topk_ids: torch.Tensor, table: torch.Tensor, window: int,
                 mirror: tuple[torch.Tensor, ...] | None = None, stream: StreamSplit | None = None,
                 bypass: int = 0, out: ControlOutputs | None = None,
                 spent: torch.Tensor | None = None) -> ControlOutputs:
        """The control kernel on this pool's state with ``table``, admission ``window`` and
        ``bypass`` slots (a seed uses none: it only makes experts resident)."""
        out = self.outputs(topk_ids.numel()) if out is None else out
        control_step(layer, topk_ids.contiguous(), self.slot_of, self.slot_owner, self.last_used, self.clock,
                     table, self.totals, out, mirror=mirror, block_slots=self.max_slots, stream=stream,
                     admit_window=window, bypass=bypass, last_active=self.last_active, recur_window=self.recur,
                     spent=spent)
        return out

    def prefetch(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Make ``layer``'s *predicted* experts ``topk_ids [T, k]`` resident ahead of its step:
        a control step in prefetch mode (``control_step(prefetch=True)``: the q* rule's fills of
        the predicted misses, victims only outside the admission window, at least one call, so
        never a slot the layer running now uses; no counters but ``prefetch_totals``, no routing
        history, the clock unchanged) on the current stream, then its copies on a copy stream of
        their own, so they cross PCIe while the current layer computes. The layer's real step then
        finds the right guesses resident. Call after the running layer's control step (and
        its copies: they go first); one prefetch outstanding at a time; not with ``set_behind``.
        The guessed layer's ``step`` counts these fills against its share, and its experts wait
        for the copies (``wait_prefetched``). No host sync."""
        if self.behind is not None:
            raise ValueError("a prefetch cannot run beside fills behind the CPU (set_behind(None) first)")
        out = self.guessed.outputs(topk_ids.numel(), self.slot_of.shape[1], self.slot_owner.numel())
        control_step(layer, topk_ids.contiguous(), self.slot_of, self.slot_owner, self.last_used, self.clock,
                     self.fill_table, self.guessed.totals, out, block_slots=self.max_slots,
                     admit_window=max(self.window, 1), last_active=self.last_active, recur_window=self.recur,
                     prefetch=True)
        self.guessed.launch(layer, out, lambda o: self._gather_fills(layer, o))

    def wait_prefetched(self) -> None:
        """Make the current stream wait for the copies of the last ``prefetch`` if nothing waited
        for them yet (a no-op otherwise, and on the CPU, where they ran inline). Before anything
        reads the slots of the layer the prefetch was for."""
        self.guessed.wait()

    def prefetch_counters(self) -> dict[str, int]:
        """The prefetch steps' counts since construction: hits (guesses already resident), misses,
        fills (experts copied ahead), cpu_computed (guesses left out by the q* rule) (one sync)."""
        return self.guessed.counters()

    def copy(self, layer: int, out: ControlOutputs) -> None:
        """The copies of a control step run with ``copy=False``: its fills into their slots and,
        with the streamed split, the streamed rows into the scratch slots. One launch each. (After
        an outstanding prefetch's copies: a fill may take a slot a wrong guess is being copied to.)"""
        self.wait_prefetched()
        self._gather_fills(layer, out)
        if self.behind is not None:
            self.behind.after_fills(self, layer, out)
        if self.stream is not None:
            stream_rows_copy(self.bank_w13, self.bank_w2, *self.scratch, layer, out.cpu_exp, out.stream_rows,
                             stage=self.stream.stage)

    def _gather_fills(self, layer: int, out: ControlOutputs) -> None:
        """The control step ``out``'s fills: bank rows into their slots, one launch."""
        gather_fill_rows(self.bank_w13, self.bank_w2, self.w13_slots, self.w2_slots, layer, out.fill_exp, out.fill_slot)

    def run_experts(self, layer: int, x: torch.Tensor, pair_tok: torch.Tensor, out: ControlOutputs,
                    beside=None, copy: bool = True, guess: tuple[int, torch.Tensor] | None = None,
                    math: dict | None = None) -> tuple[torch.Tensor, object]:
        """Queue ``layer``'s fills (``copy``; False when ``step`` already copied them) and the GPU
        experts of the control step ``out``; returns ``(rows, beside())`` (None without ``beside``,
        a callable of device work independent of the experts, e.g. the layer's shared expert).
        ``rows [P, H]`` holds every hit's and filled pair's row; the CPU pairs' rows are unset.

        With ``overlap_hits`` and a pool smaller than the experts, the hits and ``beside`` run on a
        side stream while the fills cross PCIe, and only the filled experts wait for the copies:
        a layer whose fills take longer than its CPU experts no longer adds the hits' time after
        PCIe. The rows are those of one call over every pair, bit for bit (a slot's pairs form one
        tile either way). A pool that holds every expert fills nothing after warm-up: one call.

        ``guess`` (``(layer + 1, ids)``): once this layer's fills are queued, ``prefetch`` the next
        layer's guessed experts (their copies cross PCIe while this layer's filled experts, the
        next layer's step and its CPU branch run; the next layer's ``run_experts`` waits for
        them). ``math``: ``moe_slots_forward``'s keyword arguments for experts of another kind
        (``act``, ``b13``, ``pair_bias``: gpt-oss)."""
        fwd = functools.partial(moe_slots_forward, x, self.w13_slots, self.w2_slots, pair_tok, zero=False,
                                **(math or {}))
        self.wait_prefetched()            # this layer's guesses, copied during the layer before
        if not (copy and self.overlap_hits and self.slot_owner.numel() < self.slot_of.numel()):
            if copy:
                self.copy(layer, out)
            if guess is not None:
                self.prefetch(*guess)
            rows = fwd(out.pair_slot)
            return rows, beside() if beside is not None else None
        rows = x.new_empty((out.pair_slot.numel(), x.shape[1]))
        side = self._side
        if side is not None:
            main = torch.cuda.current_stream(self.device)
            side.wait_stream(main)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            fwd(out.pair_hit_slot, out=rows)
            extra = beside() if beside is not None else None
        self.copy(layer, out)
        if guess is not None:
            self.prefetch(*guess)
        fwd(out.pair_fill_slot, out=rows)
        if side is not None:
            main.wait_stream(side)
        return rows, extra

    def streamed_forward(self, x: torch.Tensor, pair_tok: torch.Tensor, out: ControlOutputs,
                         rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """The GPU's part of the streamed pairs (rows [0, stream_rows) of their experts, zero rows
        for every other pair), or None when the streamed split is off. After ``copy``."""
        if self.stream is None or self.stream.stage:
            return None
        return moe_slots_forward(x, *self.scratch, pair_tok, out.pair_stream, out=rows, limit=out.stream_rows)

    def stage_forward(self, act: torch.Tensor, out: ControlOutputs, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The split by stage's GPU part: the down projection of every pair the control step marked
        (``out.pair_stream``) from the host's activations ``act [>= P, I]`` (pinned; read once the
        caller has waited for them), zero rows for the other pairs. After ``copy``."""
        return stage_down_forward(act, self.scratch[1], out.pair_stream, out=rows)

    @contextlib.contextmanager
    def all_resident(self):
        """Every (layer, expert) resident for the duration (expert i of the flattened
        ``[L, E]`` table in LRU slot ``i % S``; the pools' bytes are whatever they hold), so no
        step fills or leaves a pair to the CPU: nothing reads the bank, which may still be being
        read. For capturing decode graphs ahead of time while the bank loads: a graph holds the
        tables' addresses, not their values (the copy kernels are still launched, so the bank's
        start must be registered already: ``PackedModel.pin_head``). On exit the residency, the
        clock and the counters are what they were (restored in place, in stream order). The
        caller syncs any host work first (``OffloadedExperts``)."""
        state = (self.slot_of, self.slot_owner, self.last_used, self.clock, self.totals, self.last_active,
                 *((self.behind.state,) if self.behind is not None else ()))
        saved = [t.clone() for t in state]
        if self.behind is not None:
            self.behind.pause()     # its completion would copy its staged expert into a real slot
        n_slots, n_experts = self.slot_owner.numel(), self.slot_of.numel()
        self.slot_of.copy_((torch.arange(n_experts, device=self.device) % n_slots).view_as(self.slot_of))
        slots = torch.arange(n_slots, device=self.device)
        held = slots < n_experts                # slot s holds expert s (and others when fewer slots)
        self.slot_owner.copy_(torch.where(held, slots, -1))
        self.last_used.copy_(torch.where(held, self.clock, -1))
        try:
            yield
        finally:
            for t, old in zip(state, saved):
                t.copy_(old)

    def host_clock(self) -> int:
        """The device clock (one sync)."""
        return int(self.clock.item())

    def counters(self) -> dict[str, int]:
        """Totals since construction or the last ``write_back``: hits, misses, fills,
        cpu_computed, counted per distinct expert as the cache counts them (one sync)."""
        return dict(zip(COUNTERS, (int(v) for v in self.totals.tolist())))
