"""CUDA graphs of the decode step: one graph launch per token instead of a few thousand kernels.

A decode step (every sequence of the batch adds one token) is captured once per key
``(B, width)``: B sequences, KV index padded to ``width`` keys (the next power of two, at least
256, at most the context), so a handful of graphs covers a conversation's whole length. The
whole forward pass is inside: embeddings, attention over the paged KV pool, the routers, the
expert cache's device control step with its fills, the GPU experts and, when misses are computed
on the CPU, the sync-free CPU branch (``cache/host_branch.py``: its flags and waits are device
kernels, its host loop is started before each replay). Logits come out of one static buffer
``[max_batch, V]`` that every graph writes at the end of its replay (made outside the graphs'
memory pool), so a graph keeps no output of its own: what the captures allocate is freed after
each and reused by the next, and the graphs' memory stays that of the largest step instead of
growing with every batch size and width captured.

A key's first step runs eagerly (it compiles what the step needs and is the step's real output);
the graph is captured right after and replayed from the next step with the same key.
``ModelRunner.warm_graphs`` does that ahead of time, before any request, for batch sizes 1..N at
the narrowest widths (``widths``; ``--graph-warmup-widths``), and ``ModelRunner.warm_idle`` for
the wider ones while a server is idle: each key's step runs on one scratch KV block (a dummy
token at the last position of the width), so a request's decode steps replay instead of
waiting for a capture. ``tried`` keeps the keys a capture was attempted for (until ``clear``),
so that none is attempted twice. Inputs
cross in one copy: ``inputs.decode_arrays`` packs token ids, positions, KV slots, lengths and the
KV index into one int64 array. The padded keys are masked, so a replay computes what the eager
step computes; float32 logits agree within summation-order noise (tested on the GPU).

A captured graph also holds device memory of its own, outside the allocator: its executable
image, 12-14 MB for a 48-layer MoE step on the H200 (bench/graph_memory.py), so every batch size
at every width would take gigabytes. That memory is measured (``cudaMemGetInfo`` after a sync:
what the device's free memory lost across each capture and across a graph's first replay, its
upload) and reported (``held_bytes``, since the start; the metric ``freetoken_decode_graph_bytes``),
and bounded (``limit_bytes``, ``--graph-memory-gb``): once the graphs have taken the limit, their
number is capped there, and a capture first drops the graph replayed least recently. The driver
keeps a destroyed graph's memory for the next graphs rather than freeing it (measured;
docs/gpu.md), so the new graph reuses the dropped one's memory and the device's memory stops
growing. A graph replayed within the last ``KEEP_STEPS`` steps is never dropped: the new key's
steps then stay eager (a capture costs about ten eager steps, so trading graphs back and forth
would cost more than it saves), and the warm-up captures only into free room (``evict=False``),
so it never drops a conversation's graphs.

Every tensor a graph reads outside its own memory pool is kept alive by ``_Graph`` (a freed one
would be reused by the allocator under the graph). Graphs hold the addresses of the KV pool,
the expert cache's pools and residency, the CPU branch's buffers and the rotary table: the
runner drops them all (``clear``) whenever the cache is resized or q* changes. A capture that
fails drops every graph too, and they are captured again on use; after ``MAX_CAPTURE_FAILURES``
failures (an op that syncs fails every time) decode stays eager for the process. Captures run
with Python's cyclic collector off (see ``capture``).
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from ..layers.batch import AttnBatch
from . import cuda_warm
from .inputs import SeqChunk, decode_arrays

log = logging.getLogger(__name__)

MIN_WIDTH = 256


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    staging: torch.Tensor     # pinned int64, the packed inputs of one step
    inputs: torch.Tensor      # the same on the device (the graph reads it)
    rows: torch.Tensor        # [B] arange: each sequence's row (the graph reads it too)
    logits: torch.Tensor      # [B, V] rows of the shared output buffer, written by the graph
    mode: str | None          # experts' graph mode ("device" / "branch"), None without experts
    copied: torch.cuda.Event  # the last copy out of ``staging`` (it is reused only after that)
    bytes: int = 0            # device memory the capture and the first replay took (measured)
    uploaded: bool = False    # replayed once: the first launch uploads the graph (more memory)
    used: int = 0             # DecodeGraphs.clock at its capture or last replay (a decode step count)
    hidden: torch.Tensor | None = None   # [B, H] the final hidden states (a model with an MTP head)
    feed: torch.Tensor | None = None     # [B, H] an MTP pass's input hidden states (copied in each replay)


class DecodeGraphs:
    """Captured decode steps of one ``ModelRunner`` (its model, KV pool and expert executor)."""

    #: a graph replayed within this many decode steps (replays, and eager steps that try a capture)
    #: is never dropped for a new one
    KEEP_STEPS = 64
    #: failed captures after which decode stays eager for good. A failure drops every graph (as a
    #: resize does: a failed capture may leave its pool half written) and they are captured again
    #: on use, so a passing cause costs some eager steps; an op that cannot be captured fails
    #: every time and ends here
    MAX_CAPTURE_FAILURES = 3

    def __init__(self, model, kv, experts, device: torch.device, dtype: torch.dtype, max_context: int,
                 max_batch: int, limit_bytes: int = 0, chained: bool = False, mtp: bool = False):
        self.model, self.kv, self.experts, self.device = model, kv, experts, device
        # ``mtp``: passes of the MTP layer (``DecoderLM.mtp_forward``, rows of one token each, as
        # ``runner.mtp_forward`` makes them) instead of decode steps: the output is the head's
        # [B, H], the input hidden states are copied into the graph's ``feed`` before each replay
        self.mtp = mtp
        # a hybrid model whose graphs also take a draft's verification as chained rows: each
        # row's state slot written and its continuation flag are inputs too (decode_arrays)
        self.chained = chained
        self.max_context, self.max_batch = max_context, max_batch
        self.limit_bytes = limit_bytes             # 0: no limit
        self.enabled = True
        self.replays = 0
        self.clock = 0
        self.dropped = 0           # graphs dropped to stay under the limit
        self.refused = 0           # captures not made: every graph was in use, or the warm-up found no room
        self.capture_failures = 0  # captures that failed (``MAX_CAPTURE_FAILURES`` of them: eager for good)
        self.cap: int | None = None  # graphs at most, once they have taken limit_bytes (``_room``)
        # device memory the graphs took (captures and first replays) since the start: not reset
        # by ``clear``, since the driver keeps a dropped graph's memory for the next ones
        self.held_bytes = 0
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.tried: set[tuple[int, int]] = set()      # keys a capture was attempted for
        self._pool = None
        self._out: torch.Tensor | None = None          # [max_batch, V] float32, every graph's logits
        self._hidden: torch.Tensor | None = None       # [max_batch, H]: their final hidden states (MTP)
        self._feed: torch.Tensor | None = None         # [max_batch, H]: an MTP pass's input rows
        # the rotary tables must never be regrown under a graph: size them for the whole context now
        for rotary in model.rotaries():
            rotary.cos_sin(torch.zeros(1, dtype=torch.int64, device=device), dtype, max_context - 1)

    def width(self, keys: int) -> int:
        w = MIN_WIDTH
        while w < keys:
            w *= 2
        return min(w, max(self.max_context, keys))

    def widths(self) -> list[int]:
        """Every KV width a key can have: powers of two from MIN_WIDTH, capped at the context."""
        out, w = [], MIN_WIDTH
        while True:
            out.append(self.width(min(w, self.max_context)))
            if w >= self.max_context:
                return sorted(set(out))
            w *= 2

    def key(self, chunks: list[SeqChunk]) -> tuple[int, int] | None:
        """The graph key of a forward pass, or None when it is not a capturable decode step."""
        if not self.enabled or not 0 < len(chunks) <= self.max_batch:
            return None
        if any(len(c.tokens) != 1 or c.snapshots or (c.state >= 0 and c.start == 0) for c in chunks):
            return None       # a prompt's chunk, an anchor checkpoint, a recurrent state started: eager
        return len(chunks), self.width(max(c.start + 1 for c in chunks))

    def __contains__(self, key) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self.tried.clear()
        self._pool = None

    def capture_failed(self, exc: Exception) -> None:
        """After a failed capture: drop every graph (captured again on use); the
        ``MAX_CAPTURE_FAILURES``-th failure leaves decode eager for the process."""
        self.capture_failures += 1
        self.clear()
        if self.capture_failures >= self.MAX_CAPTURE_FAILURES:
            self.enabled = False
            log.warning("CUDA graph capture failed (%s: %s), %d times; decode stays eager", type(exc).__name__,
                        exc, self.capture_failures)
        else:
            log.warning("CUDA graph capture failed (%s: %s); the decode graphs are dropped and captured again on "
                        "use (failure %d of %d)", type(exc).__name__, exc, self.capture_failures,
                        self.MAX_CAPTURE_FAILURES)

    def replay(self, chunks: list[SeqChunk], key: tuple[int, int], hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the graph of ``key`` for ``chunks`` (``hidden``: an MTP pass's input rows) ->
        its logits [B, V] (an MTP pass: the head's output [B, H]), a copy."""
        g = self._graphs[key]
        self.clock += 1
        g.used = self.clock
        arrays = decode_arrays(chunks, self.kv.block_size, key[1], self._chained(chunks))
        with torch.cuda.device(self.device):        # the engine's device, whichever is current
            g.copied.synchronize()
            g.staging.numpy()[:] = arrays
            g.inputs.copy_(g.staging, non_blocking=True)
            g.copied.record()
            if g.feed is not None:
                g.feed.copy_(hidden)
            if g.mode is not None:
                self.experts.begin_replay(key[0], g.mode, mtp=self.mtp)
            if g.uploaded:
                g.graph.replay()
            else:                                    # its first launch uploads it: measured
                free = self._free()
                g.graph.replay()
                taken = max(0, free - self._free())
                g.bytes, g.uploaded = g.bytes + taken, True
                self.held_bytes += taken
        self.replays += 1
        if g.hidden is not None:
            self.model.last_hidden = g.hidden       # read before the next replay (executor/mtp.py)
        return g.logits.clone()

    def _room(self, evict: bool) -> bool:
        """Whether a new graph may be captured. Until the graphs have taken ``limit_bytes``, always;
        from then on their number is the limit (``cap``, the graphs held when it was reached), and
        a new graph takes the place of the one replayed least recently, dropped now when ``evict``
        and when it was not replayed in the last ``KEEP_STEPS`` steps. A count, not bytes: the
        driver keeps a dropped graph's memory for the next graphs (``held_bytes`` never goes
        down), so as many graphs as fitted keep fitting, after a ``clear`` too. A new graph larger
        than the one it replaces takes a little more (2 MB steps, docs/gpu.md). Called once per
        eager decode step that tries a capture, which counts as a step: the graphs it did not use
        age, so a batch decoding only in a refused key gets its graph after ``KEEP_STEPS`` steps."""
        self.clock += 1
        if not self.limit_bytes:
            return True
        if self.cap is None:
            if self.held_bytes < self.limit_bytes:
                return True
            self.cap = max(1, len(self._graphs))
        if len(self._graphs) < self.cap:
            return True
        victim = min(self._graphs, key=lambda k: self._graphs[k].used)
        if not evict or self.clock - self._graphs[victim].used < self.KEEP_STEPS:
            self.refused += 1
            return False
        del self._graphs[victim]              # its memory goes to the next capture
        self.tried.discard(victim)
        self.dropped += 1
        return True

    def capture(self, chunks: list[SeqChunk], key: tuple[int, int], evict: bool = True) -> None:
        """Capture the step ``chunks`` (already run eagerly once: kernels compiled, buffers made)
        if it fits under the limit (``_room``); an MTP pass's input hidden states are an input
        buffer of the graph (``replay``'s ``hidden``)."""
        b, width = key
        self.tried.add(key)
        cuda_warm.wait()                   # a capture must not see another thread's CUDA calls
        mode = None
        if self.experts is not None:
            mode = self.experts.graph_mode(b, mtp=self.mtp)
            if mode is None:
                return                     # a per-layer sync: this step stays eager
        if not self._room(evict):
            return
        chained = self._chained(chunks)
        arrays = decode_arrays(chunks, self.kv.block_size, width, chained)
        staging = torch.from_numpy(arrays).pin_memory()
        inputs = staging.to(self.device)
        ids, positions, slots, ends = inputs[:4 * b].view(4, b)
        kv_index = inputs[4 * b:4 * b + b * width].view(b, width)
        states = inputs[4 * b + b * width:4 * b + b * width + b] if chunks[0].state >= 0 else None
        chain = tuple(inputs[4 * b + b * width + b:].view(2, b)) if chained else None
        rows = torch.arange(b, device=self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        hid = self.model.cfg.hidden_size
        wdtype = self.model.lm_head.weight.dtype
        if self._out is None:     # an MTP pass's output is the head's hidden state, a step's the logits
            self._out = torch.empty(self.max_batch, hid if self.mtp else self.model.lm_head.weight.shape[0],
                                    dtype=wdtype if self.mtp else torch.float32, device=self.device)
            self._feed = torch.empty(self.max_batch, hid, dtype=wdtype, device=self.device) if self.mtp else None
        out = self._out[:b]
        feed = self._feed[:b] if self.mtp else None
        hidden = None
        if self.model.mtp is not None and not self.mtp:
            if self._hidden is None:
                self._hidden = torch.empty(self.max_batch, self.model.cfg.hidden_size, dtype=self.model.lm_head.weight.dtype,
                                           device=self.device)
            hidden = self._hidden[:b]
        free = self._free()
        graph = torch.cuda.CUDAGraph()
        if self.experts is not None:
            self.experts.capturing(True)
        # No cyclic garbage collection inside the capture: a collection there frees whatever dead
        # cycles hold (another engine's graphs, pinned buffers), and a graph destroyed during a
        # capture invalidates it (torch no longer collects before a capture), which left decode
        # eager for the engine's life. The garbage is collected after the capture instead.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self._pool):
                kv_valid = torch.arange(width, device=self.device)[None, :] < ends[:, None]
                batch = AttnBatch(positions=positions, slot_mapping=slots, q_seq=rows,
                                  q_idx=torch.zeros_like(rows), kv_index=kv_index, kv_valid=kv_valid,
                                  q_max=1, needs_mask=True, max_position=self.max_context - 1, kv_len=ends,
                                  state_index=states, state_chain=chain)
                if self.mtp:
                    out.copy_(self.model.mtp_forward(ids, feed, batch, self.kv, rows))
                else:
                    out.copy_(self.model(ids, batch, self.kv, rows))
                if hidden is not None:
                    hidden.copy_(self.model.last_hidden)
        except Exception as exc:        # noqa: BLE001 - any capture failure: drop the graphs, say why
            self.capture_failed(exc)
            return
        finally:
            if collecting:
                gc.enable()
            if self.experts is not None:
                self.experts.capturing(False)
        taken = max(0, free - self._free())
        self._graphs[key] = _Graph(graph, staging, inputs, rows, out, mode, torch.cuda.Event(), taken, used=self.clock,
                                   hidden=hidden, feed=feed)
        self.held_bytes += taken

    def _chained(self, chunks: list[SeqChunk]) -> bool:
        """The step's graph takes chained rows (a hybrid model's, when ``chained``)."""
        return self.chained and chunks[0].state >= 0

    def _free(self) -> int:
        """The device's free memory once its queued work is done (``cudaMemGetInfo``)."""
        torch.cuda.synchronize(self.device)
        return torch.cuda.mem_get_info(self.device)[0]
