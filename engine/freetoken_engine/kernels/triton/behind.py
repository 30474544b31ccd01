"""Fills behind the CPU: PCIe's idle time in decode copies, slice by slice, an expert the CPU
computed into the cache (the ``fill-behind`` rule of ``bench/split_policy_sim.py``).

With q* balanced, a layer call's PCIe idles while the CPU computes its share of the misses, but
for less than one expert's fill, so no whole expert fits. Over a step the idle time adds up:
one background copy moves, a slice per call, the first CPU-computed miss of the call that
started it into a staging row of the device (one expert, outside the pool); once its last slice
is in, it is copied device to device into an LRU victim and is resident. No slot is held while
the copy crosses PCIe (stop 70's first form reserved its victim at the start: at 16 GB, H100 run
4, that cost about as many hits as the copies brought).

Two kernels per layer call, after the call's control step and its fill gather, in stream order:

``behind_plan`` (one program) on ``state`` (int64 [7]: owner = layer * E + expert or -1 when
idle, slot, lo, hi, words copied and experts made resident (counters), finalize):

1. Complete: with a copy whose words are all in (hi == W, the expert's words in w13 then w2),
   take the least recently used slot not used by this call (key ``(last_used + 1) << 20 |
   slot``, as the control step orders victims) and, with a fill admission window w > 0, unused
   for more than w calls (the control step's own rule for its fills); its old owner loses
   residency and the expert becomes resident there (``slot_of``, ``slot_owner``, ``last_used``
   = the call's clock), with ``finalize`` set for the copy kernel. No such slot: it waits for
   a later call. An expert made resident elsewhere meanwhile (a control step filled it) is
   dropped, whatever its words.
2. Start: when idle (and not completing in this call, whose staging row is being read) and the
   call left c > 0 misses to the CPU with a budget (below) > 0, the copy's owner is the call's
   first CPU expert (``cpu_exp[0]``).
3. Slice: the call's budget is ``floor(safety * max(0, cpu_time[c] - q) * W)`` words, with q
   the call's fills (bypass rows included) and ``cpu_time[c]`` the CPU's time for c experts in
   units of one expert's fill (``c * f / (1 - f) / speed(c)``, the q* rule's own cost: see
   ``kernels/split.py``); [lo, hi) = [hi, min(hi + budget, W)).

``behind_copy`` (``chunks`` programs): with ``finalize``, the staging row into the slot (device to
device); else words [lo, hi) of the owner's bank rows into the staging row (the GPU reads the
pinned bank directly, as the fill gather does).

Nothing is read on the host; both launches have fixed grids, so they are captured in decode
graphs. The residency changes only in step 1, in stream order with the control steps, so no other
writer of it (a seed, a prefill's fills, a write-back, a resize) needs to know of the copy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..split import fills_for
from ._common import check_contiguous, check_tensor, next_pow2
from .gather import GATHER_TILES, _words, check_bank_copy

_SLOT_BITS = 20
#: the share of a call's idle PCIe time a slice may take (the rest covers the rates' drift)
SAFETY = 0.8
#: ``state``'s fields
OWNER, SLOT, LO, HI, COPIED, RESIDENT, FINALIZE = range(7)


@triton.jit(do_not_specialize=["S", "layer"])
def _plan_kernel(state_ptr, counts_ptr, cpu_exp_ptr, cpu_time_ptr, slot_of_ptr, owner_ptr, last_used_ptr,
                 clock_ptr, layer, E, S, W, safety, window, SLOT_BITS: tl.constexpr, BLOCK_S: tl.constexpr):
    owner = tl.load(state_ptr)
    hi = tl.load(state_ptr + 3)
    now = tl.load(clock_ptr) - 1                 # the clock this call's control step stamped
    fin = owner * 0
    if owner >= 0:
        if tl.load(slot_of_ptr + owner) >= 0:    # a control step filled it meanwhile: drop the copy
            owner = owner * 0 - 1
        elif hi >= W:                            # 1. complete: into an idle LRU slot, if there is one
            s = tl.arange(0, BLOCK_S)
            lu = tl.load(last_used_ptr + s, mask=s < S, other=0)
            idle = (lu < now) & ((window <= 0) | (lu < now - window))      # the fills' admission rule
            key = tl.where((s < S) & idle, ((lu + 1) << SLOT_BITS) | s, 0x7FFFFFFFFFFFFFFF)
            best = tl.min(key, 0)
            if best != 0x7FFFFFFFFFFFFFFF:
                v = best & ((1 << SLOT_BITS) - 1)
                old = tl.load(owner_ptr + v)
                if old >= 0:
                    tl.store(slot_of_ptr + old, -1)
                tl.store(slot_of_ptr + owner, v.to(slot_of_ptr.dtype.element_ty))
                tl.store(owner_ptr + v, owner)
                tl.store(last_used_ptr + v, now)
                tl.store(state_ptr + 1, v)
                tl.store(state_ptr + 5, tl.load(state_ptr + 5) + 1)
                fin = fin + 1
                owner = owner * 0 - 1
        tl.store(state_ptr, owner)
    fills = tl.load(counts_ptr + 2)
    n_cpu = tl.load(counts_ptr + 3)
    spare = tl.load(cpu_time_ptr + n_cpu) - fills.to(tl.float32)
    budget = tl.floor(safety * tl.maximum(spare, 0.0) * W).to(tl.int64)
    if (owner < 0) & (fin == 0) & (n_cpu > 0) & (budget > 0):  # 2. start
        owner = layer * E + tl.load(cpu_exp_ptr)
        hi = hi * 0
        tl.store(state_ptr, owner)
    lo = hi
    if owner >= 0:                               # 3. this call's slice
        hi = tl.minimum(hi + budget, W)
    tl.store(state_ptr + 2, lo)
    tl.store(state_ptr + 3, hi)
    tl.store(state_ptr + 4, tl.load(state_ptr + 4) + hi - lo)
    tl.store(state_ptr + 6, fin)


@triton.jit
def _copy_kernel(src13_ptr, src2_ptr, stage13_ptr, stage2_ptr, dst13_ptr, dst2_ptr, state_ptr, ROW13, ROW2,
                 CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    owner = tl.load(state_ptr)
    v = tl.load(state_ptr + 1)
    lo = tl.load(state_ptr + 2)
    hi = tl.load(state_ptr + 3)
    off = tl.arange(0, BLOCK)
    # (while loops: Triton 3.6's interpreter cannot take a tensor as a range bound)
    if tl.load(state_ptr + 6) != 0:              # finalize: the staging row into its slot
        base = c * BLOCK
        while base < ROW13 + ROW2:
            idx = base + off
            in13 = idx < ROW13
            tl.store(dst13_ptr + v * ROW13 + idx, tl.load(stage13_ptr + idx, mask=in13), mask=in13)
            i2 = idx - ROW13
            in2 = (i2 >= 0) & (i2 < ROW2)
            tl.store(dst2_ptr + v * ROW2 + i2, tl.load(stage2_ptr + i2, mask=in2), mask=in2)
            base += CHUNKS * BLOCK
    elif owner >= 0:                             # this call's slice: bank rows into the staging row
        base = lo + c * BLOCK
        while base < hi:
            idx = base + off
            in13 = (idx < hi) & (idx < ROW13)
            tl.store(stage13_ptr + idx, tl.load(src13_ptr + owner * ROW13 + idx, mask=in13), mask=in13)
            i2 = idx - ROW13
            in2 = (idx < hi) & (i2 >= 0)
            tl.store(stage2_ptr + i2, tl.load(src2_ptr + owner * ROW2 + i2, mask=in2), mask=in2)
            base += CHUNKS * BLOCK


def cpu_time_table(fill_fraction: float, experts: int, device: torch.device,
                   speed: tuple[float, ...] | None = None) -> torch.Tensor:
    """``[E + 1]`` float32: the CPU's time for n experts in units of one expert's PCIe fill,
    ``n * f / (1 - f) / speed(n)`` (0 where f is 0 or 1: no CPU branch, or no PCIe to spare)."""
    fills_for(0, fill_fraction)               # the same ValueError outside [0, 1]
    if not 0.0 < fill_fraction < 1.0:
        return torch.zeros(experts + 1, dtype=torch.float32, device=device)
    ratio = fill_fraction / (1.0 - fill_fraction)
    rows = [n * ratio / (speed[min(n, len(speed)) - 1] if speed and n else 1.0) for n in range(experts + 1)]
    return torch.tensor(rows, dtype=torch.float32, device=device)


def new_state(device: torch.device) -> torch.Tensor:
    """An idle copy's state: owner -1, slot 0, lo = hi = 0, both counters 0, no finalize."""
    return torch.tensor([-1, 0, 0, 0, 0, 0, 0], dtype=torch.int64, device=device)


def behind_plan(state: torch.Tensor, layer: int, step_counts: torch.Tensor, cpu_exp: torch.Tensor,
                cpu_time: torch.Tensor, slot_of: torch.Tensor, slot_owner: torch.Tensor, last_used: torch.Tensor,
                clock: torch.Tensor, words: int, safety: float = SAFETY, block_slots: int | None = None,
                window: int = 0) -> None:
    """Steps 1-3 of the module docstring for the call of ``layer`` whose control step wrote
    ``step_counts`` [4] and ``cpu_exp``; mutates ``state``, ``slot_of``, ``slot_owner`` and
    ``last_used`` in place. ``words``: an expert's 8-byte words (w13 and w2). ``block_slots``: as
    ``control_step``'s (a resized pool compiles nothing). ``window``: the fill admission window
    (0: none). Raises ValueError on bad tensors."""
    dev = slot_of.device
    check_tensor("slot_of", slot_of, 2, (torch.int32, torch.int64), dev)
    check_contiguous("slot_of", slot_of)
    for name, t, n in (("state", state, 7), ("step_counts", step_counts, 4), ("clock", clock, 1)):
        check_tensor(name, t, 1, (torch.int64,), dev)
        if t.numel() != n:
            raise ValueError(f"{name} needs {n} elements, got {t.numel()}")
    for name, t in (("slot_owner", slot_owner), ("last_used", last_used), ("cpu_exp", cpu_exp)):
        check_tensor(name, t, 1, (torch.int64,), dev)
    n_layers, experts = slot_of.shape
    slots = slot_owner.numel()
    check_tensor("cpu_time", cpu_time, 1, (torch.float32,), dev)
    if cpu_time.numel() != experts + 1 or last_used.numel() != slots or not 0 <= layer < n_layers:
        raise ValueError(f"cpu_time needs {experts + 1} entries ({cpu_time.numel()}), last_used one per slot, "
                         f"layer {layer} < {n_layers}")
    if words <= 0 or not 0.0 <= safety <= 1.0 or (block_slots is not None and block_slots < slots):
        raise ValueError(f"need words > 0, safety in [0, 1] and block_slots >= {slots}")
    _plan_kernel[(1,)](state, step_counts, cpu_exp, cpu_time, slot_of, slot_owner, last_used, clock, layer,
                       experts, slots, words, float(safety), int(window), SLOT_BITS=_SLOT_BITS,
                       BLOCK_S=next_pow2(block_slots or slots), num_warps=4)


def behind_copy(bank_w13: torch.Tensor, bank_w2: torch.Tensor, staging: tuple[torch.Tensor, torch.Tensor],
                w13_slots: torch.Tensor, w2_slots: torch.Tensor, state: torch.Tensor, chunks: int | None = None,
                block: int | None = None) -> None:
    """With ``state``'s finalize set, copy the staging row (``staging``: ``[2I, H]`` / ``[H, I]``
    on the slots' device) into slot ``state[SLOT]`` of ``[S, 2I, H]`` / ``[S, H, I]``; else words
    [lo, hi) of the copy's expert (flat row ``owner`` of the bank ``[L, E, 2I, H]`` / ``[L, E, H,
    I]``, pinned host memory on a GPU) into the staging row; nothing when idle or lo == hi. One
    launch of ``chunks`` programs."""
    check_bank_copy(bank_w13, bank_w2, w13_slots, w2_slots, 0)
    dev = w13_slots.device
    check_tensor("state", state, 1, (torch.int64,), dev)
    st13, st2 = staging
    if st13.shape != w13_slots.shape[1:] or st2.shape != w2_slots.shape[1:] or st13.dtype != w13_slots.dtype \
            or st2.dtype != w2_slots.dtype or st13.device != dev or st2.device != dev:
        raise ValueError("the staging row must be one slot's rows, of the pool's dtype, on its device")
    s13, s2 = _words("bank_w13", bank_w13, 2), _words("bank_w2", bank_w2, 2)
    d13, d2 = _words("w13_slots", w13_slots, 1), _words("w2_slots", w2_slots, 1)
    t13, t2 = _words("staging w13", st13[None], 1), _words("staging w2", st2[None], 1)
    chunks = GATHER_TILES["chunks"] if chunks is None else chunks
    block = GATHER_TILES["block"] if block is None else block
    _copy_kernel[(chunks,)](s13, s2, t13, t2, d13, d2, state, s13.shape[-1], s2.shape[-1], CHUNKS=chunks,
                            BLOCK=block, num_warps=GATHER_TILES["warps"])


def expert_words(bank_w13: torch.Tensor, bank_w2: torch.Tensor) -> int:
    """One expert's 8-byte words in the bank (its w13 rows, then its w2 rows)."""
    return (bank_w13[0, 0].numel() * bank_w13.element_size() + bank_w2[0, 0].numel() * bank_w2.element_size()) // 8
