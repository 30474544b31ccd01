"""One MoE layer's expert-cache control step as one device kernel (no host sync).

Specification (the expert cache's torch control step, bit for bit), for layer ``l``:

1. active = unique(topk_ids) ascending; hits = active experts with ``slot_of[l, e] >= 0``;
   misses = the others, ascending.
2. ``m = len(misses)``; ``q = min(fill_table[m], S - n_hits)`` where the host precomputed
   ``fill_table[m] = fills_for(m, fill_fraction)`` (``kernels/split.py``: of floor and ceil of
   f m, the one with the smaller max(q / B_pcie, (m - q) / B_cpu); the cache's own rule, exactly).
   With a fill admission window W > 0, q is further capped by the number of admissible victims:
   slots not holding a hit that are empty or were last used before ``clock - W``. With NB bypass
   slots (pool rows S..S+NB-1, outside the LRU), b = min(fill_table[m] - q, NB) of the refused
   fills still cross PCIe, into those rows, for this call only (``cache/experts.py``).
3. The misses are ordered recurring first: with a recurrence window R > 0 (``last_active``,
   the clock of each (layer, expert)'s last routing), a miss routed in this layer within the
   last R calls (the step before, R = the MoE layer count) comes before the others, each group in
   ascending id. The first q misses in that order are filled, the next b go to slots S + j (no
   residency change), the rest to the CPU. Every routed expert's ``last_active`` = clock. Victims are the q slots with the smallest
   ``(last_used, slot)`` among slots not holding a hit (empty slots have last_used -1, so go
   first); the i-th filled miss takes the i-th victim. Old owners lose residency; ``slot_of``
   and ``slot_owner`` are updated. The weight copy is a separate kernel (``gather.py``).
4. ``last_used`` of every hit and filled slot = clock; ``clock += 1``.
5. ``pair_slot[p]`` = slot of pair p after the fills, -1 for pairs computed on the CPU;
   ``pair_hit_slot[p]`` / ``pair_fill_slot[p]``: pair_slot where p's expert was a hit / was
   filled by this step, else -1 (a caller computes the hits while the fills are copied).

Optional host mirror (``mirror=(pair_slot_host [P], counts_host [4])`` or with a third tensor
``pair_exp_host [P]``, pinned host memory on a GPU): the kernel also stores pair_slot, the step's
counts (and the routed expert of every pair) there, so a host that waits for the step reads
which pairs it must compute, and with which experts, without a device-to-host copy.

Why hits are never victims: the kernel first stamps the hits' slots with the current clock,
which is larger than every stored ``last_used``; the q <= S - n_hits smallest keys are then
exactly the smallest non-hit slots. Outputs have fixed sizes (-1 padded) and the counts live
in device tensors, so the step can be captured in a CUDA graph. One program does the whole
step (E <= 1024, S < 2**20 slots); the LRU choice is q rounds of a block-wide minimum over the
S keys ``(last_used + 1) << 20 | slot`` (a full bitonic sort cost 88 us at S = 3209 and 205 us at
S = 4585 on the H200; this costs O(q * S) and no sort). A call without a miss skips reading the S
clocks at all (``SKIP_WITHOUT_MISSES``: 1.01-1.04x a resident decode step on the H200, docs/gpu.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_contiguous, check_tensor, next_pow2
from .control_outputs import ControlOutputs, StreamSplit

_SLOT_BITS = 20
MAX_SLOTS = 1 << _SLOT_BITS
#: a call without a miss skips the pool-wide scan (see the kernel); False for A/B measurements
SKIP_WITHOUT_MISSES = True


@triton.jit(do_not_specialize=["S", "NB"])   # a resized pool (and its bypass rows) must not recompile
def _control_kernel(topk_ptr, slot_of_ptr, owner_ptr, last_used_ptr, clock_ptr, fill_table_ptr,
                    pair_slot_ptr, pair_hit_ptr, pair_fill_ptr, fill_exp_ptr, fill_slot_ptr, cpu_exp_ptr,
                    step_ptr, totals_ptr,
                    keys_ptr, newslot_ptr, mirror_ps_ptr, mirror_counts_ptr, mirror_ids_ptr, layer,
                    P, E, S, NF, pair_stream_ptr, stream_rows_ptr, cpurank_ptr, mirror_from_ptr,
                    share, INTER, GRANULE, NS, window, NB, last_active_ptr, recur_window, spent_ptr,
                    BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_F: tl.constexpr, SLOT_BITS: tl.constexpr, MIRROR: tl.constexpr,
                    MIRROR_IDS: tl.constexpr, STREAM: tl.constexpr, MIRROR_FROM: tl.constexpr,
                    STAGE: tl.constexpr, RECUR: tl.constexpr, SKIP: tl.constexpr, PREFETCH: tl.constexpr,
                    SPENT: tl.constexpr):
    p = tl.arange(0, BLOCK_P)
    pm = p < P
    ids = tl.load(topk_ptr + p, mask=pm, other=-1).to(tl.int64)               # [BLOCK_P]
    e = tl.arange(0, BLOCK_E)
    em = e < E
    present = tl.sum(((ids[None, :] == e[:, None]) & pm[None, :]).to(tl.int32), 1) > 0   # [BLOCK_E]
    row_ptr = slot_of_ptr + layer * E
    slot = tl.load(row_ptr + e, mask=em, other=-1).to(tl.int64)
    hit = present & (slot >= 0)
    miss = present & (slot < 0)
    n_hit = tl.sum(hit.to(tl.int64), 0)
    m = tl.sum(miss.to(tl.int64), 0)
    if SPENT:
        # a prefetch already filled F of this call's guessed experts: the call's share is that of
        # its misses and those F together, less the F already spent
        spent = tl.load(spent_ptr).to(tl.int64)
        target = tl.maximum(tl.load(fill_table_ptr + tl.minimum(m + spent, E)).to(tl.int64) - spent, 0)
    else:
        target = tl.load(fill_table_ptr + m).to(tl.int64)
    q = tl.minimum(target, S - n_hit)
    clock = tl.load(clock_ptr)
    if RECUR:
        # recurring misses first: routed in this layer within the last `recur_window` calls (none
        # when it is 0: la < clock); the routing history is kept either way
        la = tl.load(last_active_ptr + layer * E + e, mask=em, other=-1)
        rec = miss & (la >= 0) & (clock - la <= recur_window)
        n_rec = tl.sum(rec.to(tl.int64), 0)
        rank = tl.where(rec, tl.cumsum(rec.to(tl.int64), 0) - 1,
                        n_rec + tl.cumsum((miss & ~rec).to(tl.int64), 0) - 1)            # among misses
        if not PREFETCH:      # a guess is not a routing
            tl.store(last_active_ptr + layer * E + e, clock, mask=present)
    else:
        rank = tl.cumsum(miss.to(tl.int64), 0) - 1                              # among misses

    # Stamp the hits first: they now hold the largest keys and are never chosen below. A prefetch
    # stamps with the clock of the step before (the one running now), so that every stored clock
    # stays below the guessed layer's own step: the hits of that step, stamped with its clock,
    # then stay the largest keys even against wrong guesses, which remain its plain LRU victims.
    stamp = clock
    if PREFETCH:
        stamp = tl.maximum(clock - 1, 0)
    tl.store(last_used_ptr + slot, stamp, mask=hit)
    f = tl.arange(0, BLOCK_F)
    fm = f < NF
    tl.store(fill_exp_ptr + f, -1, mask=fm)
    tl.store(fill_slot_ptr + f, -1, mask=fm)
    tl.store(cpu_exp_ptr + f, -1, mask=fm)
    tl.debug_barrier()
    # The pool-wide part (every slot's clock read, the admissible count, the victims' rounds)
    # only when the call has a miss (SKIP): a call of hits fills nothing (q = fill_table[0] = 0),
    # and reading all S clocks is most of a resident step's control time.
    scan = m > 0
    if not SKIP:
        scan = m >= 0
    if scan:
        s = tl.arange(0, BLOCK_S)
        sm = s < S
        lu = tl.load(last_used_ptr + s, mask=sm, other=0)
        # Fill admission: only victims idle for more than `window` calls (hits were stamped with
        # the clock above, so they never qualify); they are exactly the smallest keys below.
        admissible = sm & ((window <= 0) | (lu < 0) | (lu < clock - window))
        q = tl.maximum(tl.minimum(q, tl.sum(admissible.to(tl.int64), 0)), 0)
        key = tl.where(sm, ((lu + 1) << SLOT_BITS) | s, 0x7FFFFFFFFFFFFFFF)      # unique per slot
        # The q smallest keys in ascending order: q rounds of a block-wide min (q <= the call's
        # distinct experts, a handful in decode), much cheaper than sorting all S keys.
        # (a while loop: Triton 3.6's interpreter cannot take a tensor as a range bound)
        r = q * 0
        while r < q:
            smallest = tl.min(key, 0)
            tl.store(keys_ptr + r, smallest)
            key = tl.where(key == smallest, 0x7FFFFFFFFFFFFFFF, key)
            r += 1
    qf = q + tl.minimum(target - q, NB)           # the refused fills go to the bypass slots S..S+NB
    fill = miss & (rank < q)
    byp = miss & (rank >= q) & (rank < qf)
    cpu = miss & (rank >= qf)
    tl.debug_barrier()

    victim = tl.load(keys_ptr + rank, mask=fill, other=0) & ((1 << SLOT_BITS) - 1)
    victim = tl.where(byp, S + rank - q, victim)
    old = tl.load(owner_ptr + victim, mask=fill, other=-1)
    tl.store(slot_of_ptr + old, -1, mask=fill & (old >= 0))                     # old owners lose residency
    tl.store(row_ptr + e, victim.to(slot_of_ptr.dtype.element_ty), mask=fill)
    tl.store(owner_ptr + victim, layer * E + e, mask=fill)
    tl.store(last_used_ptr + victim, stamp, mask=fill)
    tl.store(fill_exp_ptr + rank, e, mask=fill | byp)
    tl.store(fill_slot_ptr + rank, victim, mask=fill | byp)
    tl.store(cpu_exp_ptr + rank - qf, e, mask=cpu)
    # per expert: its slot if a hit, -(slot + 2) if filled now (bypass too), -1 if computed on the CPU
    tl.store(newslot_ptr + e, tl.where(hit, slot, tl.where(fill | byp, -victim - 2, -1)), mask=em)
    if STREAM:
        tl.store(cpurank_ptr + e, tl.where(cpu, rank - qf, -1), mask=em)
    tl.debug_barrier()

    v = tl.load(newslot_ptr + ids, mask=pm & (ids >= 0), other=-1)
    ps = tl.where(v >= -1, v, -v - 2)
    tl.store(pair_slot_ptr + p, ps, mask=pm)
    tl.store(pair_hit_ptr + p, tl.where(v >= 0, v, -1), mask=pm)
    tl.store(pair_fill_ptr + p, tl.where(v < -1, ps, -1), mask=pm)
    c = tl.arange(0, 4)
    counts = tl.where(c == 0, n_hit, tl.where(c == 1, m, tl.where(c == 2, qf, m - qf)))
    tl.store(step_ptr + c, counts)
    mirrored = ps
    if STREAM:
        # Streamed split: the first NS CPU experts' rows [0, rows) go to the GPU too, rows chosen
        # so that PCIe (qf whole experts, bypass included, + the streamed rows) and the CPU (the
        # rest) take equal time at the PCIe share `share`: rows / I = (c share - qf (1 - share)) / cs.
        n_cpu = m - qf
        cr = tl.load(cpurank_ptr + ids, mask=pm & (ids >= 0), other=-1)
        if STAGE:
            # Split by stage: the first n CPU experts' W2 (a third of an expert) crosses PCIe and
            # their W13 stays on the CPU; equal time when (qf + n/3) (1 - share) = (n_cpu - n/3)
            # share, i.e. n = 3 (n_cpu share - qf (1 - share)). stream_rows holds n.
            want = 3.0 * (n_cpu.to(tl.float32) * share - qf.to(tl.float32) * (1.0 - share))
            rows = tl.minimum(tl.maximum(tl.floor(want + 0.5).to(tl.int64), 0), tl.minimum(n_cpu, NS))
            pstream = tl.where((v == -1) & (cr >= 0) & (cr < rows), cr, -1)
            mirrored = tl.where(pstream >= 0, -3, ps)
        else:
            n_str = tl.minimum(n_cpu, NS)
            frac = (n_cpu.to(tl.float32) * share - qf.to(tl.float32) * (1.0 - share)) / tl.maximum(n_str, 1).to(tl.float32)
            rows = (tl.floor(frac * INTER / GRANULE + 0.5)).to(tl.int64) * GRANULE
            rows = tl.where(n_str > 0, tl.minimum(tl.maximum(rows, 0), INTER - GRANULE), 0)
            pstream = tl.where((v == -1) & (cr >= 0) & (cr < NS) & (rows > 0), cr, -1)
            mirrored = tl.where(pstream >= 0, -2, ps)
        tl.store(pair_stream_ptr + p, pstream, mask=pm)
        tl.store(stream_rows_ptr, rows)
        if MIRROR_FROM:
            tl.store(mirror_from_ptr, rows)
    if MIRROR:
        tl.store(mirror_ps_ptr + p, mirrored, mask=pm)
        tl.store(mirror_counts_ptr + c, counts)
    if MIRROR_IDS:
        tl.store(mirror_ids_ptr + p, ids, mask=pm)
    tl.store(totals_ptr + c, tl.load(totals_ptr + c) + counts)
    if not PREFETCH:          # a prefetch stamps with the clock of the step it runs ahead of
        tl.store(clock_ptr, clock + 1)


def control_step(layer: int, topk_ids: torch.Tensor, slot_of: torch.Tensor, slot_owner: torch.Tensor,
                 last_used: torch.Tensor, clock: torch.Tensor, table: torch.Tensor,
                 totals: torch.Tensor, out: ControlOutputs,
                 mirror: tuple[torch.Tensor, ...] | None = None,
                 block_slots: int | None = None, stream: "StreamSplit | None" = None,
                 admit_window: int = 0, bypass: int = 0, last_active: torch.Tensor | None = None,
                 recur_window: int = 0, prefetch: bool = False,
                 spent: torch.Tensor | None = None) -> ControlOutputs:
    """Run the control step for ``layer`` (see the module docstring); mutates slot_of,
    slot_owner, last_used, clock ([1] int64) and totals ([4] int64) in place and fills ``out``
    (and ``mirror``: int64 [P], [4] and optionally [P], contiguous; pinned host memory on a GPU).

    All tensors on one device; slot_of [L, E] int32/int64, slot_owner / last_used [S] int64,
    topk_ids [T, k] int. ``block_slots`` (>= S): size the slot block for a pool that may grow to
    that many slots, so that resizing it never compiles a new kernel in the middle of serving
    (a compile costs seconds on a GPU); default: S. ``stream``: also choose the streamed split
    (``out.pair_stream``, ``out.stream_rows``); a fourth mirror tensor ([1] int64) then receives
    stream_rows. ``admit_window``: the fill admission window (step 2; 0 = plain LRU). ``bypass``:
    pool rows S..S+bypass-1 past the LRU slots that refused fills may use (step 3).
    ``last_active`` ([L, E] int64): the routing history, stamped for every routed expert; with
    ``recur_window`` W > 0 recurring misses come first (step 3). ``prefetch``: a step on
    *predicted* ids ahead of the layer's real one (``DeviceControl.prefetch``): the same hits, fills
    and victims, but the clock does not advance (hits and fills are stamped with the clock before,
    that of the step running now: the guessed layer's own step, at the clock, must find every
    stored clock below its own, or a wrong guess could tie with its hits and one of them become a
    victim), the routing history is not stamped, and the counts go to ``totals`` (the caller's
    prefetch counters); it needs ``admit_window >= 1`` (victims then carry a clock below the
    running step's, so never a slot the running layer uses), no bypass, mirror or stream split.
    ``spent`` (int64, one element on the device: the fills of the prefetch made for this call,
    ``step_counts[2:3]`` of its outputs): F experts of the call's PCIe share already crossed, so
    the call fills ``max(fill_table[min(m + F, E)] - F, 0)`` of its m misses: with right guesses
    the prefetch and the call together fill what the call alone would have, and guesses that were
    resident already (F = 0) leave the call its own share.
    Raises ValueError on bad shapes, dtypes, strides or sizes.
    """
    dev = slot_of.device
    check_tensor("slot_of", slot_of, 2, (torch.int32, torch.int64), dev)
    check_contiguous("slot_of", slot_of)
    n_layers, experts = slot_of.shape
    check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64), dev)
    check_contiguous("topk_ids", topk_ids)
    for name, t in (("slot_owner", slot_owner), ("last_used", last_used)):
        check_tensor(name, t, 1, (torch.int64,), dev)
        check_contiguous(name, t)
    check_tensor("clock", clock, 1, (torch.int64,), dev)
    check_tensor("totals", totals, 1, (torch.int64,), dev)
    check_tensor("table", table, 1, (torch.int32, torch.int64), dev)
    slots = slot_owner.numel()
    pairs = topk_ids.numel()
    if last_used.numel() != slots or not 0 < slots < MAX_SLOTS:
        raise ValueError(f"need 0 < S < {MAX_SLOTS} and len(last_used) == len(slot_owner), got {slots}")
    if not 0 <= layer < n_layers or table.numel() != experts + 1 or experts > 1024:
        raise ValueError(f"layer {layer} of {n_layers}, table of {table.numel()} for E={experts} (E <= 1024)")
    if out.pair_slot.numel() != pairs or out.keys.numel() < slots or out.newslot.numel() < experts:
        raise ValueError("ControlOutputs were allocated for another batch, pool or expert count")
    m_ids = None
    if mirror is not None:
        if len(mirror) not in (2, 3, 4) or (len(mirror) == 4 and stream is None):
            raise ValueError(f"mirror is (pair_slot, counts[, pair_exp[, stream_rows]]) (stream_rows with "
                             f"stream=), got {len(mirror)} tensors")
        m_ps, m_counts, m_ids, m_from = (*mirror, None, None)[:4]
        checks = [("mirror pair_slot", m_ps, pairs), ("mirror counts", m_counts, 4)]
        checks += [("mirror pair_exp", m_ids, pairs)] if m_ids is not None else []
        checks += [("mirror stream_rows", m_from, 1)] if m_from is not None else []
        for name, t, n in checks:
            check_tensor(name, t, 1, (torch.int64,))
            check_contiguous(name, t)
            if t.numel() != n:
                raise ValueError(f"{name} needs {n} elements, got {t.numel()}")
            if dev.type == "cuda" and not (t.device == dev or t.is_pinned()):
                raise ValueError(f"{name} must be pinned host memory or on {dev}")
    else:
        m_ps, m_counts, m_from = out.pair_slot, out.step_counts, None  # unused (MIRROR=False)
    if stream is not None:
        stream.check()
    if bypass < 0:
        raise ValueError(f"bypass slots must be >= 0, got {bypass}")
    if prefetch and (admit_window < 1 or bypass or mirror is not None or stream is not None):
        raise ValueError("a prefetch step needs admit_window >= 1 and no bypass, mirror or stream split")
    if spent is not None:
        check_tensor("spent", spent, 1, (torch.int64,), dev)
        if spent.numel() != 1:
            raise ValueError(f"spent must hold one count, got {spent.numel()}")
    recur = last_active is not None
    if recur:
        check_tensor("last_active", last_active, 2, (torch.int64,), dev)
        check_contiguous("last_active", last_active)
        if tuple(last_active.shape) != (n_layers, experts):
            raise ValueError(f"last_active must be [{n_layers}, {experts}], got {tuple(last_active.shape)}")
    if block_slots is not None and block_slots < slots:
        raise ValueError(f"block_slots {block_slots} < the pool's {slots} slots")
    block_s = next_pow2(block_slots or slots)
    nf = out.fill_exp.numel()
    _control_kernel[(1,)](
        topk_ids, slot_of, slot_owner, last_used, clock, table,
        out.pair_slot, out.pair_hit_slot, out.pair_fill_slot, out.fill_exp, out.fill_slot, out.cpu_exp,
        out.step_counts, totals,
        out.keys, out.newslot, m_ps, m_counts, m_ids if m_ids is not None else m_ps, layer, pairs,
        experts, slots, nf, out.pair_stream, out.stream_rows, out.cpurank,
        m_from if m_from is not None else out.stream_rows,
        *(stream.args(topk_ids.shape[0]) if stream is not None else (0.0, 1, 1, 0)), int(admit_window), int(bypass),
        last_active if recur else clock, max(int(recur_window), 0), spent if spent is not None else clock,
        BLOCK_P=next_pow2(pairs), BLOCK_E=next_pow2(experts), BLOCK_S=block_s,
        BLOCK_F=next_pow2(nf), SLOT_BITS=_SLOT_BITS, MIRROR=mirror is not None, MIRROR_IDS=m_ids is not None,
        STREAM=stream is not None, MIRROR_FROM=m_from is not None, STAGE=stream is not None and stream.stage,
        RECUR=recur, SKIP=SKIP_WITHOUT_MISSES, PREFETCH=prefetch,
        SPENT=spent is not None, num_warps=8 if block_s > 2048 else 4)
    return out
