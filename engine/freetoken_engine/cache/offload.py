"""Runs the routed experts of one MoE layer call: the q* split of the design.

``OffloadedExperts.forward(layer, x, topk_ids)`` returns one output row per (token, k) pair.

- Decode-sized calls (fewer than ``prefill_threshold`` tokens) go through the expert cache:
  hits and the q* fills are computed from the slot pool on the cache's device, the other misses
  on the CPU straight from the bank; both write their pairs' rows into one output, so every
  pair's value is the same wherever it was computed.
- Larger calls (prefill) touch nearly every expert and run the whole layer from a layer buffer
  given by the streamer (``layer(l) -> (w13 [E,2I,H], w2 [E,H,I])``); on the CPU that is a view
  of the bank, on the GPU a copy (double-buffered by ``cache/prefetch.py`` when available).
  With the device control step the experts the slot pool holds are computed from the pool in
  place and the streamer's buffer brings only the others (over PCIe).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging

import torch

from .. import env
from ..kernels import cpu_branch, cpu_expert_forward
from ..kernels.reference import expert_pairs_forward
from .bank import ExpertBank
from .expert_math import ExpertMath
from .experts import ExpertCache
from .layer_weights import BankStreamer, WholeLayers

log = logging.getLogger(__name__)
#: the streamed split's scratch slots (env FREETOKEN_STREAM_SPLIT): a batch-1 step's CPU experts
STREAMED = 8


def _triton_importable() -> bool:
    try:
        return importlib.import_module("triton") is not None
    except ImportError:
        return False


class OffloadedExperts:
    """``backend``: ``torch`` (the reference control step and expert math), ``triton`` (the
    device control step, one-launch fills, the Triton MoE kernel and the double-buffered prefill
    streamer of ``cache/device_control.py`` / ``cache/prefetch.py``; on a CPU only under
    ``TRITON_INTERPRET=1``, for tests) or ``auto`` (triton on CUDA when importable)."""

    #: whole-layer calls compute the experts the slot pool holds from the pool in place, and the
    #: streamer copies only the others (over PCIe). False: the streamer also copies the cached ones
    #: into its layer buffer on the device (the engine before 2026-12-01; the ``gather`` side of
    #: bench/prefill_cached.py).
    prefill_in_place = True
    #: whole-layer calls fill the pool's empty slots from their buffer (``DeviceControl.fill_free``);
    #: False: only the last chunk's seed does (the engine before 2026-12-01's twenty-fourth session)
    prefill_fills_free = True

    def __init__(self, bank: ExpertBank, cache: ExpertCache, prefill_threshold: int,
                 cpu_backend: str | None = None, backend: str = "auto", top_k: int = 8,
                 step_layers: int | None = None):
        """``step_layers``: the bank's layers a decode step runs (default all); the others (an MTP
        layer) run in passes of their own, outside the sync-free CPU branch's steps."""
        self.bank, self.cache, self.top_k = bank, cache, top_k
        self.step_layers = bank.num_layers if step_layers is None else step_layers
        self.host_branch = self.mtp_branch = None   # CPU branches: the decode steps', the MTP layer's own
        self._guess: tuple[int, torch.Tensor] | None = None   # (layer, ids): the next layer's guess
        self.device = cache.device
        self.prefill_threshold = prefill_threshold
        self._pair_tok: dict[tuple[int, int], torch.Tensor] = {}
        self.math = ExpertMath()   # the model's experts, when of another kind (gpt-oss; the runner's)
        self.cpu_backend_name, self.cpu_forward = cpu_expert_forward(cpu_backend)
        self.seeded = 0          # experts the prefills copied into the cache (_seed_cache)
        self.filled_free = 0     # experts the prefills copied into empty slots (DeviceControl.fill_free)
        self.seed_now = True     # the runner's: this forward ends some sequence's prompt
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" and _triton_importable() else "torch"
        self.backend = backend
        # the sync-free CPU branch (cache/host_branch.py): decided once, built on first use
        self._want_branch = (backend == "triton" and self.cpu_backend_name == "compiled"
                             and env.host_branch())
        self._prefetch = env.expert_prefetch()
        self.control = None
        if backend == "triton":
            from ..kernels.triton.moe import moe_slots_forward
            from .device_control import DeviceControl
            from .prefetch import LayerStreamer as DoubleBuffered
            self.control = DeviceControl.from_cache(cache, resizable=True)
            self.control.set_fill_fraction(self._control_fraction())
            if env.fill_behind():
                self.control.set_behind()
            # Rows of CPU pairs are never read from the device's output (the combine selects per
            # pair, kernels/triton/combine.py), so they are not zeroed. A call uses at most a
            # layer's experts (what a large call on 4-bit slots counts its rounds by).
            self.slots_forward = functools.partial(moe_slots_forward, zero=False, experts=bank.num_experts)
            self.streamer: WholeLayers = DoubleBuffered(bank, cache.device, cache)
        elif self.device.type == "cpu":
            # Same arithmetic on both sides of the split: outputs cannot depend on the split.
            self.slots_forward = self.cpu_forward
            self.streamer = BankStreamer(bank, cache.device)
        else:
            self.slots_forward = expert_pairs_forward
            self.streamer = BankStreamer(bank, cache.device)
        # prefill seeds the decode cache (with the device control step; while not every expert fits)
        self._seed = self.control is not None and env.prefill_seed()

    def _seed_cache(self, layer: int, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Prefill seeds the decode cache: in a forward that ends a prompt (``seed_now``, set by
        the runner from ``SeqChunk.last``), the experts of the call's last token (those the first
        decode step most likely routes to again) are copied into the cache from the whole-layer
        buffer the prefill just used, device to device, instead of crossing PCIe one step at a
        time in the first decode steps. Residency only: no output changes."""
        self.streamer.settle()           # the double-buffered streamer (the Triton path's)
        n = self.control.seed(layer, topk_ids, w13, w2)
        self.seeded += n
        if n:
            self.streamer.refresh()

    def _host_branch(self, x: torch.Tensor, layer: int = 0):
        """The sync-free CPU branch (``cache/host_branch.py``) of ``layer``'s step when it applies:
        the Triton path with the compiled CPU kernel as the CPU backend; built on first use, None
        otherwise. A decode step's layers share one; the layers past ``step_layers`` (an MTP
        layer, run in passes of its own) another."""
        mtp = layer >= self.step_layers
        if self._want_branch and (self.mtp_branch if mtp else self.host_branch) is None:
            from .host_branch import HostBranch
            try:
                if mtp:
                    self.mtp_branch = HostBranch(self.bank, self.top_k, self._branch_tokens(), self.device, x.dtype,
                                                 first=self.step_layers)
                    self.math.gate_branch(self.mtp_branch.br, self.step_layers, self.mtp_branch.layers)
                    return self.mtp_branch
                self.host_branch = HostBranch(self.bank, self.top_k, self._branch_tokens(), self.device, x.dtype,
                                              layers=self.step_layers)
                self.math.gate_branch(self.host_branch.br, 0, self.step_layers)
                mode = env.stream_split()
                # the streamed and staged splits compute parts of experts: plain dense experts only
                if mode != "off" and self.device.type == "cuda" and self.math.plain and not self.bank.mxfp4:
                    try:   # scratch for STREAMED experts' rows: that many experts' bytes of device memory
                        self.control.set_stream(min(STREAMED, self.bank.w13.shape[1]), floor_fills=mode == "floor",
                                                stage=mode == "stage")
                    except ValueError as exc:   # an intermediate size the granule does not split
                        log.info("streamed split unavailable (%s)", exc)
            except (RuntimeError, ValueError) as exc:    # e.g. too many pairs per call: keep the sync path
                log.info("sync-free CPU branch unavailable (%s); syncing per layer", exc)
                self._want_branch = False
        return self.mtp_branch if mtp else self.host_branch

    def wants_guess(self, layer: int, tokens: int) -> bool:
        """Whether a decode call of ``layer`` should guess the next layer's experts for a prefetch
        (``env.expert_prefetch``: calls of up to that many tokens; one by default when on): the
        device control runs the call (without the streamed split),
        the next layer is one of the step's, and not every expert fits (nothing to fetch then)."""
        return (tokens <= self._prefetch and self.control is not None and self.control.stream is None
                and tokens < self.prefill_threshold and layer + 1 < self.step_layers
                and self.cache.capacity < self.bank.total_experts)

    def guess(self, layer: int, ids: torch.Tensor) -> None:
        """The next call's layer and guessed ``ids [T, k]``: prefetched once the current layer's
        own fills are queued (``DeviceControl.run_experts``)."""
        self._guess = (layer, ids)

    def _take_guess(self, layer: int):
        g, self._guess = self._guess, None
        return g if g is not None and g[0] == layer + 1 else None

    def branches(self) -> list:
        """The CPU branches built so far (the decode step's, the MTP layer's)."""
        return [b for b in (self.host_branch, self.mtp_branch) if b is not None]

    def _finish_branches(self) -> None:
        for b in self.branches():
            b.finish()

    def _branch_tokens(self) -> int:
        """The most tokens a call answered by the host branch has: every decode-sized call, within
        the branch's pair limit (a larger call syncs per layer instead)."""
        return max(1, min(self.prefill_threshold - 1, cpu_branch.MAX_PAIRS // self.top_k))

    def end_step(self) -> None:
        """After a forward pass: wait for its CPU-branch host loop and raise RuntimeError if either
        side gave up waiting for the other, so a broken step fails instead of returning wrong
        logits (one sync, which the sampler needs anyway)."""
        self._finish_branches()

    # -- CUDA graphs of the decode step (executor/graphs.py) ---------------------------------------
    def graph_mode(self, tokens: int, mtp: bool = False) -> str | None:
        """How a decode step of ``tokens`` tokens (``mtp``: a pass of the MTP layer) can be
        captured, as the last eager one ran it: ``"device"`` (every miss filled: device work only),
        ``"branch"`` (the sync-free CPU branch: each replay needs ``begin_replay``), or None (a
        per-layer sync: not capturable)."""
        if self.control is None or tokens >= self.prefill_threshold:
            return None
        if self._fills_only(tokens):
            return "device"
        branch = self.mtp_branch if mtp else self.host_branch
        return "branch" if branch is not None and tokens <= self._branch_tokens() else None

    def _control_fraction(self) -> float:
        """q*/m for the device control step: every miss is filled once every expert fits (a fill
        is then never evicted), else the calibrated split."""
        return 1.0 if self.cache.capacity == self.bank.total_experts else self.cache.fill_fraction

    def _fills_only(self, tokens: int) -> bool:
        """Whether every miss of a decode call is filled: q* says so (and the slots hold every
        pair), or every expert fits, so that a fill is never evicted and beats any CPU pass."""
        c = self.cache
        return (c.fill_fraction >= 1.0 and c.capacity >= tokens * self.top_k) or c.capacity == self.bank.total_experts

    @contextlib.contextmanager
    def beside_prefill(self):
        """A decode step between two layers of a whole-layer pass (decode beside a prefill): its
        fills may evict experts the streamer's queued load left out as cached, so, as for the seed,
        the stream first waits for a load that reads the pool, and afterwards the streamer re-reads
        the residency and puts back what the step evicted. Residency only: no output changes."""
        if self.control is None:
            yield
            return
        self.streamer.settle()
        try:
            yield
        finally:
            self.streamer.refresh()

    def capturing(self, on: bool) -> None:
        for b in self.branches():
            b.capturing = on

    @contextlib.contextmanager
    def all_resident(self):
        """Every expert resident while inside (``DeviceControl.all_resident``): decode steps read
        nothing from the bank, so graphs can be captured while it is still being read. Residency,
        clock and counters come back as they were; the host branch's step is finished first."""
        self.sync_stats()
        with self.control.all_resident():
            try:
                yield
            finally:
                self._finish_branches()
        self.cache.clock = self.control.host_clock()

    def begin_replay(self, tokens: int, mode: str, mtp: bool = False) -> None:
        if mode == "branch":
            (self.mtp_branch if mtp else self.host_branch).start_replay(tokens)

    # -- safe-point operations (scheduler thread, between forward passes) ------------------------
    def sync_stats(self) -> None:
        """Fold the device control's counters and clock into ``cache.stats`` (one sync)."""
        self._finish_branches()
        if self.control is not None:
            self.control.write_back(self.cache)

    def stats(self):
        """Counters so far, including the device control's (read-only; any thread)."""
        st = self.cache.stats
        if self.control is None:
            return st
        extra = self.control.counters()
        return type(st)(**{k: getattr(st, k) + extra[k] for k in ("hits", "misses", "fills", "cpu_computed")})

    def resize(self, capacity: int) -> None:
        self.sync_stats()                 # also ends a running CPU-branch step
        if self.control is not None:      # drop its views of the old pool so it can be freed
            self.control.w13_slots = self.control.w2_slots = None
        self.cache.resize(capacity)
        if self.control is not None:
            self.control.refresh(self.cache)
            self.control.set_fill_fraction(self._control_fraction())

    def set_fill_fraction(self, fraction: float) -> None:
        self._finish_branches()
        self.cache.fill_fraction = fraction
        if self.control is not None:
            self.control.cpu_speed = self.cache.cpu_speed      # the call-size curve comes with the split
            self.control.set_fill_fraction(self._control_fraction())

    def cpu_rate(self, seconds: float) -> float:
        """``ExpertBank.cpu_rate`` (the q* follower's probe), a CPU-branch step finished first (shared pool)."""
        self._finish_branches()
        return self.bank.cpu_rate(seconds)

    def _pair_tokens(self, t: int, k: int, device: torch.device) -> torch.Tensor:
        """``[t * k]`` token of each (token, k) pair; kept for decode-sized calls (stable addresses
        for the graphs), made afresh for whole-layer ones (a prompt's last step can have any size
        up to the prefill step's 8192 tokens: kept, they would add up to gigabytes)."""
        if t >= self.prefill_threshold:
            return torch.arange(t, device=device).repeat_interleave(k)
        key = (t, k)
        cached = self._pair_tok.get(key)
        if cached is None:
            cached = self._pair_tok[key] = torch.arange(t, device=device).repeat_interleave(k)
        return cached

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] on the device, topk_ids [T, k] -> pair outputs [T*k, H] in (t, j) order; from
        the CPU branch a ``SplitRows`` (device rows + the host's rows in pinned memory) instead."""
        return self.forward_beside(layer, x, topk_ids)[0]

    def forward_beside(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, beside=None):
        """``forward``, and ``beside()`` (device work independent of the routed experts: the
        layer's shared expert), run on a side stream with the hits while a decode call's fills
        are copied (``DeviceControl.run_experts``), else after the experts.
        Returns ``(rows, beside's result or None)``.

        Experts of another kind (gpt-oss: ``math``, the runner's ``ExpertMath.set_model``) are
        computed by every expert kernel and the CPU branch; the streamed and staged splits, which
        compute parts of experts, stay off for them."""
        t, k = topk_ids.shape
        pair_exp = topk_ids.reshape(-1)                                   # [P]
        pair_tok = self._pair_tokens(t, k, x.device)                      # [P]
        self.math.begin(layer)
        try:
            if self.control is not None and t < self.prefill_threshold and not self.bank_in_place():
                if self._fills_only(t):
                    # Every miss is filled: no CPU pair is possible, so no host sync in this layer
                    # (a decode step of such layers can be captured in a CUDA graph).
                    out = self.control.step(layer, topk_ids, copy=False)    # on the device, no sync
                    return self.control.run_experts(layer, x, pair_tok, out, beside, guess=self._take_guess(layer),
                                                    math=self.math.kwargs(x, pair_exp))
                branch = self._host_branch(x, layer) if t <= self._branch_tokens() else None
                if branch is not None:      # CPU pairs answered by a host thread: still no sync here
                    return branch.layer(self.control, layer, x, topk_ids, pair_tok, beside,
                                        guess=self._take_guess(layer), math=self.math.kwargs(x, pair_exp))
            self._guess = None              # a synchronous call: no prefetch
            if self.control is not None:
                self.control.wait_prefetched()    # (a layer before may have prefetched into the slots)
            rows = self._forward(layer, x, topk_ids, pair_tok, pair_exp)
            return rows, beside() if beside is not None else None
        finally:
            self.math.end()

    def _pool_forward(self, layer: int, x: torch.Tensor, pair_tok: torch.Tensor,
                      pair_exp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A whole-layer call with the resident experts computed from the slot pool in place, queued
        before the stream waits for the layer's load (so they run while it crosses PCIe; the next
        layer's load is queued first, so it never waits for them), then the others from the
        streamer's buffer (``layer(l, gather_cached=False)``: it holds every
        expert the pool lacked when its load was queued, and the streamer's ``refresh`` puts back
        any the prefill's seed evicted since). The residency is read on the device when the kernel
        runs, so an expert counts as resident exactly when its slot holds it. The same rows as from
        a buffer of the whole layer: each expert's pairs form one tile either way.
        Returns ``(rows, w13, w2)``: the rows and the streamer's buffer."""
        pair_slot = self.cache.slot_of[layer].to(pair_exp.device).index_select(0, pair_exp)
        rows = x.new_empty((pair_exp.numel(), x.shape[1]))
        w13, w2 = self.streamer.layer(layer, gather_cached=False, wait=False)
        math = self.math.kwargs(x, pair_exp)
        self.slots_forward(x, self.cache.w13, self.cache.w2, pair_tok, pair_slot, out=rows, **math)
        self.streamer.wait(layer)
        self.slots_forward(x, w13, w2, pair_tok, pair_exp.masked_fill(pair_slot >= 0, -1), out=rows, **math)
        return rows, w13, w2

    def _pool_in_place(self) -> bool:
        """Whole-layer calls take the cached experts from the device control's pool in place."""
        return self.prefill_in_place and self.control is not None and not self.bank_in_place()

    def bank_in_place(self) -> bool:
        """Every expert fits and the cache lives on the host: decode computes from the bank."""
        return self.cache.device.type == "cpu" and self.cache.capacity == self.bank.total_experts

    def _forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, pair_tok: torch.Tensor,
                 pair_exp: torch.Tensor) -> torch.Tensor:
        t, k = topk_ids.shape
        if t >= self.prefill_threshold:
            if self._pool_in_place():
                out, w13, w2 = self._pool_forward(layer, x, pair_tok, pair_exp)
            else:
                w13, w2 = self.streamer.layer(layer)
                fn = self.cpu_forward if w13.device.type == "cpu" and self.control is None else self.slots_forward
                out = fn(x, w13, w2, pair_tok, pair_exp, **self.math.kwargs(x))
            if self.control is not None and self.prefill_fills_free:
                self.filled_free += self.control.fill_free(layer, topk_ids, w13, w2)
            if self._seed and self.seed_now and self.cache.capacity < self.bank.total_experts:
                self._seed_cache(layer, topk_ids[-1:], w13, w2)
            return out
        if self.bank_in_place():
            # Every expert fits and the cache's device is the host: the bank *is* the resident
            # copy, so compute from it in place (no fills, no slot lookups). Each distinct
            # routed expert counts as a hit (a token's top-k experts are distinct).
            self.cache.stats.hits += k if t == 1 else int(torch.unique(pair_exp).numel())
            return self.cpu_forward(x, self.bank.w13[layer], self.bank.w2[layer], pair_tok, pair_exp,
                                    **self.math.kwargs(x))
        if self.control is not None:       # the sync path: no host branch (or it is off)
            pair_slot = self.control.step(layer, topk_ids).pair_slot
        else:
            pair_slot = self.cache.step(layer, pair_exp)                  # [P], -1 = CPU
        if self.device.type == "cpu" and bool((pair_slot >= 0).all()):
            return self.slots_forward(x, self.cache.w13, self.cache.w2, pair_tok, pair_slot,
                                      **self.math.kwargs(x, pair_exp))
        out = x.new_empty((t * k, x.shape[1]))
        on_dev = pair_slot >= 0
        cpu = ~on_dev
        if bool(on_dev.any()):
            out[on_dev] = self.slots_forward(x, self.cache.w13, self.cache.w2, pair_tok[on_dev], pair_slot[on_dev],
                                             **self.math.kwargs(x, pair_exp[on_dev]))
        if bool(cpu.any()):
            x_host = x if x.device.type == "cpu" else x.cpu()
            rows = self.cpu_forward(x_host, self.bank.w13[layer], self.bank.w2[layer],
                                    pair_tok[cpu].cpu(), pair_exp[cpu].cpu(), **self.math.kwargs(x_host))
            out[cpu] = rows.to(out.device, non_blocking=True)
        return out
