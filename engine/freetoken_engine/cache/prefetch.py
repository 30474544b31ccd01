"""Double-buffered whole-layer expert streaming for prefill.

Prefill touches nearly every expert of every layer, so it does not go through the cache's
per-expert control: ``LayerStreamer.layer(l) -> (w13 [E, 2I, H], w2 [E, H, I])`` hands the MoE
layer all of layer l's experts. On the CPU these are views of the bank (no copy). On a GPU there
are two whole-layer device buffers and a copy stream: when the model asks for layer l, layer
l+1 starts loading into the other buffer, behind the compute already queued for layer l-1
(the buffer's last reader), so PCIe streams while layer l computes. Experts the expert cache
holds are copied device to device (one gather launch), or left out for a caller that computes
them from the pool in place (``layer(l, gather_cached=False)``, cache/offload.py); only
the others cross PCIe, in one ``cudaMemcpyAsync`` per run of consecutive missing experts, from
the pinned bank.

Ordering contract: the caller uses the returned tensors on the stream that was current when it
called ``layer`` and calls ``layer`` in increasing order within a forward pass; any other order
(a new pass, a repeated layer) restarts streaming at that layer, which is correct but does not
overlap. The cache's residency is read once per pass (one host sync); a caller that changes the
pool inside a pass (the prefill's seed of the decode cache, cache/offload.py) first calls
``settle`` (its stream waits for the load already queued when that load reads the pool) and afterwards
``refresh``: the layers not yet queued see the new residency, and when the queued load left
the cached experts out, those the change evicted are copied into its buffer (over PCIe, on the
caller's stream), so the buffer again holds every expert the pool lacks.
"""
from __future__ import annotations

import torch

from ..kernels.triton.gather import gather_fill_rows


class LayerStreamer:
    """Whole-layer weights for prefill (see the module docstring). ``cache`` is optional; without
    it every expert crosses PCIe. Not thread-safe (the scheduler thread's forward uses it)."""

    def __init__(self, bank, device: torch.device | str, cache=None):
        self.bank, self.cache = bank, cache
        self.device = torch.device(device)
        self.num_layers = bank.w13.shape[0]
        self._next = -1
        self.pcie_bytes = 0          # bytes copied over PCIe since construction (stats, benchmarks)
        self.device_bytes = 0        # bytes copied from the cache on the device
        self.restored = 0            # experts put back into a queued buffer by refresh()
        self.gather_cached = True    # the last layer() call's (its queued load of the next layer's too)
        self._checked = False        # the bank is pinned (checked at first use: the engine
        if self.device.type == "cuda":  # builds this while a packed bank is still being read)
            w13, w2 = bank.w13[0], bank.w2[0]
            self._bufs = [(torch.empty_like(w13, device=self.device), torch.empty_like(w2, device=self.device))
                          for _ in range(2)]
            self._stream = torch.cuda.Stream(self.device)
            self._ready = [torch.cuda.Event(), torch.cuda.Event()]
            self._resident: torch.Tensor | None = None       # [L, E] host copy of slot_of for this pass

    def layer(self, layer: int, gather_cached: bool = True, wait: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s experts: ``(w13 [E, 2I, H], w2 [E, H, I])`` on the streamer's device;
        with ``gather_cached`` False (this call and the next layer's load it queues) the experts
        the pool holds are left out: a caller that computes them from the pool in place. With
        ``wait`` False the current stream does not wait for the load yet: the caller queues work
        that does not read the buffer, then calls ``wait(layer)`` before work that does."""
        self.gather_cached = gather_cached
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        if self.device.type != "cuda":
            return self.bank.w13[layer], self.bank.w2[layer]
        if not self._checked:
            if not (self.bank.w13.is_pinned() and self.bank.w2.is_pinned()):
                raise ValueError("LayerStreamer on a GPU needs the pinned bank (call bank.pin() first)")
            self._checked = True
        current = torch.cuda.current_stream(self.device)
        if layer != self._next:                      # a new pass (or out of order): load it now
            self._resident = self.cache.slot_of.cpu() if self.cache is not None else None
            self._load(layer, layer % 2, current)
        if wait:
            current.wait_event(self._ready[layer % 2])
        if layer + 1 < self.num_layers:
            self._load(layer + 1, (layer + 1) % 2, current)
        self._next = layer + 1
        return self._bufs[layer % 2]

    def wait(self, layer: int) -> None:
        """The current stream waits for layer ``layer``'s load (after ``layer(l, wait=False)``)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(self._ready[layer % 2])

    def settle(self) -> None:
        """The current stream waits for the load queued for the next layer when it gathers cached
        experts from the slot pool, so the pool may change after this point on that stream. A load
        that leaves the cached experts out reads only the bank: nothing to wait for (``refresh``
        puts back what a change evicts)."""
        if self.gather_cached and 0 <= self._next < self.num_layers:
            self.wait(self._next)

    def refresh(self) -> None:
        """Re-read the cache's residency (one host sync) after the pool changed inside a pass
        (after ``settle``): the layers queued from now on copy what the slots hold now, and the
        load already queued without the cached experts gets back those the pool no longer holds."""
        if self.device.type != "cuda" or self.cache is None:
            return
        old, self._resident = self._resident, self.cache.slot_of.cpu()
        layer = self._next
        if self.gather_cached or old is None or not 0 <= layer < self.num_layers:
            return
        self.restored += self._from_bank(layer, layer % 2, (old[layer] >= 0) & (self._resident[layer] < 0))

    def _from_bank(self, layer: int, buf: int, mask: torch.Tensor) -> int:
        """Copy ``layer``'s experts where the host bool ``mask [E]`` is set from the pinned bank into
        buffer ``buf`` on the current stream, one ``cudaMemcpyAsync`` per run of them; returns how many."""
        w13_buf, w2_buf = self._bufs[buf]
        n = 0
        for a, b in _runs(mask):
            w13_buf[a:b].copy_(self.bank.w13[layer, a:b], non_blocking=True)
            w2_buf[a:b].copy_(self.bank.w2[layer, a:b], non_blocking=True)
            n += b - a
        self.pcie_bytes += n * (w13_buf[0].nbytes + w2_buf[0].nbytes)
        return n

    def _load(self, layer: int, buf: int, after: torch.cuda.Stream) -> None:
        """Queue layer ``layer`` into buffer ``buf`` on the copy stream once ``after`` reaches
        this point (the buffer's previous reader, layer - 2, is queued there before it)."""
        free = torch.cuda.Event()
        free.record(after)
        w13_buf, w2_buf = self._bufs[buf]
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(free)
            slots = self._resident[layer] if self._resident is not None else None
            cached = (slots >= 0) if slots is not None else torch.zeros(w13_buf.shape[0], dtype=torch.bool)
            self._from_bank(layer, buf, ~cached)
            if slots is not None and self.gather_cached and bool(cached.any()):
                experts = cached.nonzero().flatten()
                src = slots[experts].to(self.device, non_blocking=True)
                dst = experts.to(self.device, non_blocking=True)
                gather_fill_rows(self.cache.w13[None], self.cache.w2[None], w13_buf, w2_buf, 0, src, dst)
                self.device_bytes += experts.numel() * (w13_buf[0].nbytes + w2_buf[0].nbytes)
            self._ready[buf].record(self._stream)


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """Half-open index ranges of consecutive True values of a 1-D host bool tensor."""
    runs, start = [], None
    for i, v in enumerate(mask.tolist()):
        if v and start is None:
            start = i
        elif not v and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, mask.numel()))
    return runs
