"""The shared expert cache: one pool of slots for every MoE layer, global LRU, residency table.

State (all on the cache's device, so the GPU path can run it without host syncs):

- ``w13 [S, 2I, H]``, ``w2 [S, H, I]``: the slot pool (copies of bank rows);
- ``slot_of [L_moe, E]`` int64: the slot holding (layer, expert), -1 when absent;
- ``slot_owner [S]`` int64: ``layer * E + expert`` held by each slot, -1 when empty;
- ``last_used [S]`` int64: the clock value of the slot's last use, -1 when empty or when a
  prefill filled it and no step has used it since (``DeviceControl.fill_free``): such slots are
  the first victims, like empty ones.

``step`` is the per-layer decode control, the reference for the device kernel:
deduplicate the routed experts; hits are resident; of the m misses, the first
q = min(fills_for(m, f, speed=cpu_speed), S - hits, admissible) (``kernels/split.py``: ``cpu_speed`` is
the CPU's call-size curve, None until the engine measures it; recurring misses first, then
ascending expert id, see below) are filled into the q least recently
used slots not holding a hit of this call (ties: lower slot index first; empty slots first),
the other m - q are computed on the CPU from the bank. The clock advances once per call.

Fill admission (``admit_window`` W > 0, only while the fill fraction f < 1, i.e. when misses go to
the CPU anyway): a slot is an admissible victim when it is empty or unused for more than W calls
(W = the MoE layer count: a whole decode step). When a step's experts outnumber the slots, plain
LRU evicts each expert just before the next step needs it again (the cyclic-scan failure: a miss
rate of 1.00 at batch 4 on an 8 GB card, ``bench/cache_policy_sim.py``); refusing to evict what the
last step used turns those fills into CPU work and keeps the rest of the cache useful (simulated
0.76-0.77 there), and changes nothing while the working set fits (victims are then older).

Bypass slots (``bypass`` B > 0): the pool's last B rows are outside the LRU. A fill that the
slot cap or admission refuses still crosses PCIe, into a bypass slot, for this call only (no
residency, nothing evicted): the misses keep their q* share of PCIe instead of all landing on the
CPU, which admission had overloaded while PCIe idled (Qwen3-30B shapes, locality, batch 4, 8 GB:
822 CPU experts and 167 fills a step, against 674 and 319 with 8 bypass slots and 806 / 406 with
plain LRU; ``bench/results/gpu_offload.json``, ``bypass_ab_run_33``). Of the
m misses, the first q (in the order below) fill LRU victims, the next b = min(q_target - q, B) go to
bypass slots ``S + j`` (S = the LRU slots), the rest to the CPU; ``stats.fills`` counts both.

Recurring misses first (``recur_window`` R > 0, only while f < 1, like admission):
``last_active [L_moe, E]`` keeps the clock of each expert's last routing, cached or not. Of a
call's misses, those routed in the same layer within the last R calls (R = the MoE layer count:
the step before) take the fills (and then the bypass slots) before the others, each group in
ascending id. The per-call rule computes a miss on the CPU and forgets it, so an expert that
the next token routes to again would miss again; filling the recurring ones first spends the
same q* fills on experts likely to be hit next time (``bench/split_policy_sim.py``).

Not thread-safe: the scheduler thread owns it; ``resize`` runs at a scheduler safe point.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import env
from ..kernels.split import fills_for
from .bank import ExpertBank


def admission_window(admit_window: int, fill_fraction: float) -> int:
    """The fill admission window in effect: ``admit_window`` under the q* split (misses may go to
    the CPU), 0 for a fills-only cache (f >= 1: every miss must be filled)."""
    return admit_window if fill_fraction < 1.0 else 0


def bypass_slots(capacity: int, total_experts: int, wanted: int) -> int:
    """Bypass slots of a pool of ``capacity`` rows: ``wanted``, but none when every expert fits,
    and at most a quarter of the pool (the LRU keeps the rest)."""
    return 0 if capacity >= total_experts else min(wanted, capacity // 4)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    fills: int = 0
    cpu_computed: int = 0


class ExpertCache:
    def __init__(self, bank: ExpertBank, capacity: int, device: torch.device, fill_fraction: float = 1.0,
                 admit_window: int | None = None, bypass: int = 0, recur_window: int | None = None):
        self.bank = bank
        self.device = torch.device(device)
        self.fill_fraction = fill_fraction
        self.cpu_speed: tuple[float, ...] | None = None   # the CPU's rate by call size (kernels/split.py)
        # calls a victim must have been idle (0: plain LRU); default: one decode step, unless
        # FREETOKEN_FILL_ADMISSION=off
        self.admit_window = (bank.num_layers if env.fill_admission() else 0) if admit_window is None else admit_window
        if bypass < 0:
            raise ValueError(f"bypass slots must be >= 0, got {bypass}")
        self.bypass_wanted = bypass
        # calls within which a miss counts as recurring (0: ascending id only); one decode step
        self.recur_window = bank.num_layers if recur_window is None else recur_window
        self.stats = CacheStats()
        self.clock = 0
        # the clock of each (layer, expert)'s last routing, cached or not (kept across resizes)
        self.last_active = torch.full((bank.num_layers, bank.num_experts), -1, dtype=torch.int64, device=self.device)
        self._allocate(capacity)

    # -- state -------------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        b = self.bank
        if not 1 <= capacity <= b.total_experts:
            raise ValueError(f"expert cache capacity must be within 1..{b.total_experts}, got {capacity}")
        self.capacity = capacity
        self.bypass = bypass_slots(capacity, b.total_experts, self.bypass_wanted)
        self.lru_slots = capacity - self.bypass
        # slots in the bank's own layout (MXFP4 rows stay MXFP4)
        self.w13 = torch.empty((capacity, *b.w13.shape[2:]), dtype=b.w13.dtype, device=self.device)
        self.w2 = torch.empty((capacity, *b.w2.shape[2:]), dtype=b.w2.dtype, device=self.device)
        self.slot_of = torch.full((b.num_layers, b.num_experts), -1, dtype=torch.int64, device=self.device)
        self.slot_owner = torch.full((self.lru_slots,), -1, dtype=torch.int64, device=self.device)
        self.last_used = torch.full((self.lru_slots,), -1, dtype=torch.int64, device=self.device)

    @property
    def capacity_bytes(self) -> int:
        return self.capacity * self.bank.expert_bytes

    def resident(self) -> int:
        return int((self.slot_owner >= 0).sum())

    # -- the decode control step ---------------------------------------------------------------
    def step(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        """Classify, fill and touch for one MoE layer call; return ``pair_slot [P]`` (-1 = CPU).

        ``expert_ids [P]`` are the routed experts of every (token, k) pair of the call.
        """
        row = self.slot_of[layer]                               # [E] view
        active = torch.unique(expert_ids)                       # [A] ascending
        slots = row.index_select(0, active)                     # [A]
        hit = slots >= 0
        n_hit = int(hit.sum())
        m = active.numel() - n_hit
        target = fills_for(m, self.fill_fraction, speed=self.cpu_speed) if m else 0
        q = min(target, self.lru_slots - n_hit)
        missed = active[~hit]
        recur = admission_window(self.recur_window, self.fill_fraction)
        if recur > 0 and m:
            la = self.last_active[layer].index_select(0, missed)
            rec = (la >= 0) & (self.clock - la <= recur)
            missed = torch.cat([missed[rec], missed[~rec]])              # recurring misses first
        self.last_active[layer, active] = self.clock
        window = self.window()
        if q > 0 and window > 0:
            lu = self.last_used
            ok = (lu < 0) | (lu < self.clock - window)
            ok[slots[hit]] = False                              # hits are never victims
            q = min(q, int(ok.sum()))
        b = min(target - q, self.bypass)                        # refused fills into bypass slots
        if q > 0:
            self._fill(layer, missed[:q], protected=slots[hit])
            slots = row.index_select(0, active)
        used = slots[slots >= 0] if m else slots
        self.last_used.index_fill_(0, used, self.clock)        # touch hits and fills
        self.clock += 1
        st = self.stats
        st.hits += n_hit
        st.misses += m
        st.fills += q + b
        st.cpu_computed += m - q - b
        pair_slot = row.index_select(0, expert_ids)
        if b > 0:
            passing = missed[q:q + b]
            where = torch.arange(self.lru_slots, self.lru_slots + b, device=self.device)
            self._copy_rows(layer, passing, where)
            lookup = torch.full((self.bank.num_experts,), -1, dtype=torch.int64, device=self.device)
            lookup[passing] = where
            byp = lookup.index_select(0, expert_ids)
            pair_slot = torch.where(byp >= 0, byp, pair_slot)
        return pair_slot

    def window(self) -> int:
        """The fill admission window in effect (``admission_window``)."""
        return admission_window(self.admit_window, self.fill_fraction)

    def _fill(self, layer: int, experts: torch.Tensor, protected: torch.Tensor) -> None:
        key = self.last_used.clone()
        key[protected] = torch.iinfo(torch.int64).max
        victims = torch.argsort(key, stable=True)[: experts.numel()]   # LRU first, lower index on ties
        old = self.slot_owner[victims]
        old = old[old >= 0]
        self.slot_of.view(-1)[old] = -1
        self.slot_owner[victims] = layer * self.bank.num_experts + experts
        self.slot_of[layer, experts] = victims
        self._copy_rows(layer, experts, victims)

    def _copy_rows(self, layer: int, experts: torch.Tensor, slots: torch.Tensor) -> None:
        cpu_experts = experts.cpu()
        nb = self.device.type == "cuda"
        self.w13[slots] = self.bank.w13[layer][cpu_experts].to(self.device, non_blocking=nb)
        self.w2[slots] = self.bank.w2[layer][cpu_experts].to(self.device, non_blocking=nb)

    # -- elasticity ----------------------------------------------------------------------------
    def resize(self, capacity: int) -> None:
        """Change the number of slots, keeping the most recently used residents that fit.

        Call only at a safe point (no forward pass in flight). Outputs never change: evicted
        experts are simply misses later, and the bank is the source of truth.
        """
        if not 1 <= capacity <= self.bank.total_experts:
            raise ValueError(f"expert cache capacity must be within 1..{self.bank.total_experts}, got {capacity}")
        if capacity == self.capacity:
            return
        owners, last = self.slot_owner.clone(), self.last_used.clone()
        order = torch.argsort(-last, stable=True)                # most recent first
        # Free the old pool before allocating the new one, so a shrink under memory pressure
        # never needs old + new at once; the kept residents (as many as the new LRU holds) are
        # refilled from the bank (the source of truth), which costs n expert copies at a safe point.
        self.w13 = self.w2 = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._allocate(capacity)
        keep = order[(owners[order] >= 0)][:self.lru_slots]
        kept_owners, kept_last = owners[keep], last[keep]
        n = kept_owners.numel()
        if n:
            new = torch.arange(n, device=self.device)
            layer, expert = (kept_owners // self.bank.num_experts).cpu(), (kept_owners % self.bank.num_experts).cpu()
            nb = self.device.type == "cuda"
            self.w13[:n] = self.bank.w13[layer, expert].to(self.device, non_blocking=nb)
            self.w2[:n] = self.bank.w2[layer, expert].to(self.device, non_blocking=nb)
            self.slot_owner[new] = kept_owners
            self.last_used[new] = kept_last
            self.slot_of.view(-1)[kept_owners] = new

    # -- invariants ----------------------------------------------------------------------------
    def check_integrity(self, deep: bool = False) -> None:
        """Raise AssertionError-free ``RuntimeError`` when the residency table is inconsistent.

        Checks: owners and the residency table agree one to one; empty slots have no clock;
        clocks are below the current clock; with ``deep`` each resident slot equals its bank rows.
        """
        owners = self.slot_owner.cpu()
        flat = self.slot_of.view(-1).cpu()
        live = (owners >= 0).nonzero().flatten()
        if (flat >= 0).sum() != live.numel():
            raise RuntimeError("expert cache: residency table and slot owners disagree in count")
        if live.numel() and not torch.equal(flat[owners[live]], live):
            raise RuntimeError("expert cache: residency table does not point back at its slots")
        last = self.last_used.cpu()
        if ((last >= 0) & (owners < 0)).any() or (last >= self.clock).any():
            raise RuntimeError("expert cache: LRU clocks inconsistent with residency")
        if owners.unique().numel() != owners.numel() - max(int((owners < 0).sum()) - 1, 0):
            raise RuntimeError("expert cache: an expert occupies two slots")
        if deep:
            e = self.bank.num_experts
            for s in live.tolist():
                layer, expert = divmod(int(owners[s]), e)
                if not (torch.equal(self.w13[s].cpu(), self.bank.w13[layer, expert])
                        and torch.equal(self.w2[s].cpu(), self.bank.w2[layer, expert])):
                    raise RuntimeError(f"expert cache: slot {s} differs from bank ({layer}, {expert})")
