"""Continuous batching over one ``ModelRunner``.

Every step the scheduler thread (1) runs queued commands at this safe point (expert-cache
resize, calibration), (2) drops aborted requests, (3) admits waiting requests while the batch
and the KV pool allow, reusing cached prompt prefixes from the radix tree
(``scheduler/admission.py``), (4) runs one forward pass holding every running request's next
piece of work (a prefill chunk within the token budget, or one decode token) and (5) samples,
streams and retires. When a decode step needs a
KV block and none is free, unlocked prefix-tree leaves are evicted first, then the newest
request is preempted (its KV recomputed when it is re-admitted; its output so far is kept).

A pass of at least the whole-layer threshold of prompt tokens (``expert_threshold``: its MoE
layers stream whole layers) that is expected to take ``decode_pause_ms`` or more (by the last
passes of about its size) leaves the decoding requests out: they get decode steps of their own
between the pass's layers instead, each time they have waited that long
(``scheduler/beside.py``), so a long prompt does not hold their tokens for its whole pass. Their
tokens are the same either way.

With nothing to serve, the thread captures the decode CUDA graphs the engine's start left for
later (``ModelRunner.warm_idle``: the wider KV widths), one per pass, so a request that arrives
meanwhile waits for one capture at most.

Thread-safety: ``add``, ``abort`` and ``call`` may be called from any thread; everything else
runs on the scheduler thread.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from typing import Callable

import torch

from ..cache.radix import RadixCache
from ..cache.states import Anchors, anchor_token_ids
from ..errors import InvalidRequest, NonFiniteLogits, OutOfKVCache, QueueFull
from ..executor.inputs import SeqChunk
from ..executor.runner import ModelRunner
from ..executor.guide import constrained_rows
from ..executor.sampler import sample, token_logprobs
from .admission import Admission
from .beside import DecodePause
from .drafts import Drafts
from .request import Request, TokenEvent

log = logging.getLogger(__name__)


class Scheduler(Admission, Drafts):
    def __init__(self, runner: ModelRunner, max_batch: int, max_queue: int, prefill_chunk: int,
                 decode_pause_ms: float = 0.0, speculative_tokens: int = 0,
                 speculative_ngram: tuple[int, int] = (2, 4), speculative_max_batch: int = 1,
                 speculative_method: str = "ngram"):
        self.runner, self.kv = runner, runner.kv
        # decode steps between a long pass's layers (None: the decoders ride in the pass)
        self.pause = DecodePause(decode_pause_ms / 1e3, runner.device) if decode_pause_ms > 0 else None
        self.beside_from = runner.cfg.expert_threshold
        self.radix = RadixCache(self.kv)
        if self.kv.window:      # a short window store keeps the tree's likeliest resume points
            self.kv.keep_window = lambda: self.radix.window_blocks(self.kv.cached_window_blocks)
        self.window_anchor_ids = anchor_token_ids(runner.tokenizer) if self.kv.window else frozenset()
        self.states = runner.states          # hybrid models' recurrent states (None: no such layer)
        self.anchors = (Anchors(self.states, self.kv, anchor_token_ids(runner.tokenizer))
                        if self.states is not None and self.states.checkpoint_slots else None)
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._cv = threading.Condition()
        self._commands: deque[tuple[Callable, concurrent.futures.Future]] = deque()
        self._stop = False
        self.counters = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                         "preemptions": 0, "steps": 0, "decode_steps_beside": 0,
                         "decode_beside_seconds": 0.0, "anchor_checkpoints": 0, "anchor_resumes": 0,
                         "anchor_resumed_tokens": 0}
        self._init_drafts(speculative_tokens, speculative_ngram, speculative_max_batch, speculative_method)
        self.thread = threading.Thread(target=self._loop, name="freetoken-scheduler", daemon=True)

    # -- any thread ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        with self._cv:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting; retry shortly",
                                retry_after=1.0)
            self.waiting.append(req)
            self._cv.notify()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run ``fn()`` on the scheduler thread between two forward passes."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._commands.append((fn, fut))
            self._cv.notify()
        return fut

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self.thread.join(timeout=10)

    # -- scheduler thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._commands or self.waiting or self.running):
                    if self._idle_work():
                        break
                    self._cv.wait()
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
                idle = not (commands or self.waiting or self.running)
            for fn, fut in commands:
                try:
                    fut.set_result(fn())
                except Exception as exc:  # delivered to the caller, the loop goes on
                    fut.set_exception(exc)
            if idle:
                self._warm_idle()
                continue
            try:
                self._drop_aborted()
                self._admit()
                if self.running:
                    self._step()
                elif self.waiting:       # only requests waiting for the grammar tables
                    with self._cv:
                        self._cv.wait(0.02)
            except Exception:  # a bug must not hang every client: fail the running requests
                log.exception("scheduler step failed; aborting running requests")
                for req in list(self.running):
                    self._finish(req, "abort")

    def _idle_work(self) -> bool:
        return self.runner.idle_warm_pending()

    def _warm_idle(self) -> None:
        """Nothing to serve: capture one decode graph the start left for later (a request that
        comes meanwhile waits for that one capture). Its dummy step needs one KV block: a
        cached prefix's leaf gives way when the pool is full."""
        try:
            if not self._free_blocks(1):
                raise OutOfKVCache("no KV block for the capture's dummy step")
            self.runner.warm_idle()
        except Exception:  # noqa: BLE001 - serving goes on eagerly; never retried
            log.exception("capturing a decode graph while idle failed; the rest are captured on first use")
            self.runner.idle_warm = 0

    def _drop_aborted(self) -> None:
        with self._cv:
            for req in [r for r in self.waiting if r.aborted.is_set()]:
                self.waiting.remove(req)
                self._release(req)
                req.sink.push(TokenEvent(None, "abort"))
        for req in [r for r in self.running if r.aborted.is_set()]:
            self._finish(req, "abort")

    def _ensure_block(self, req: Request, keep=()) -> bool:
        """Make room for the KV of ``req.computed + 1`` tokens, preempting others (never those whose
        ``id`` is in ``keep``: a pass is running them) if needed."""
        while self.kv.blocks_for(req.computed + 1) > len(req.blocks):
            if self._free_blocks(1):
                req.blocks += self.kv.allocate(1)
                continue
            victims = [r for r in self.running if r is not req and id(r) not in keep]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda r: r.arrival))
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.computed = req.shared = 0
        self.counters["preemptions"] += 1
        with self._cv:
            self.waiting.appendleft(req)

    def _step(self) -> None:
        budget = self.prefill_chunk
        batch = []
        for req in list(self.running):
            if req not in self.running:      # preempted by an earlier request of this step
                continue
            n = req.pending
            if n > 1:
                n = min(n, budget)
                if n == 0:
                    continue
                budget -= n
            elif not self._ensure_block(req):
                self._finish(req, "abort", error=OutOfKVCache(
                    f"the KV cache ({self.kv.num_blocks} blocks of {self.kv.block_size} tokens) cannot "
                    f"hold this request's {req.computed + 1} tokens: lower max_tokens or shorten the prompt"))
                continue
            batch.append((req, n))
        batch = [(r, n) for r, n in batch if r in self.running]
        if not batch:
            return
        decoders = [r for r, n in batch if r.pending == 1]
        prompt = sum(n for r, n in batch if r.pending > 1)
        between, timed = None, self.pause is not None and prompt >= self.beside_from
        if timed and decoders and self.pause.long(prompt):
            batch = [(r, n) for r, n in batch if r.pending > 1]
            between = self._beside(decoders, {id(r) for r, _ in batch})
            self.pause.begin()
        else:
            batch = self._with_drafts(batch)
        t0, beside = time.perf_counter(), self.counters["decode_beside_seconds"]
        chunks, writes = self._chunks(batch)
        logits = self._pass(lambda: self.runner.forward(chunks, between), writes)
        self.counters["steps"] += 1
        self._emit(batch, logits)
        self._catch_up()
        if timed:       # the pass's own time, for the next choice (its decode steps beside left out)
            self.pause.passed(prompt, time.perf_counter() - t0 - (self.counters["decode_beside_seconds"] - beside))
        if self.pause is not None and between is None:
            self.pause.tokens()           # every decoding request rode in this pass

    def _beside(self, decoders: list[Request], keep: set[int]) -> Callable[[int], None]:
        """The pass's layer hook: a decode step of ``decoders`` when ``pause`` says it is due. A
        block they need may preempt one of them, never a request of the pass (``keep``)."""
        def between(layer: int) -> None:
            if not self.pause.due():
                return
            live = [r for r in decoders if r in self.running and not r.aborted.is_set()]
            batch = [(r, 1) for r in live if self._ensure_block(r, keep)]
            batch = [(r, n) for r, n in batch if r in self.running]
            if not batch:
                return
            t0 = time.perf_counter()
            chunks, writes = self._chunks(batch)
            logits = self._pass(lambda: self.runner.decode_beside(chunks), writes)
            self._emit(batch, logits)
            took = time.perf_counter() - t0
            self.counters["decode_steps_beside"] += 1
            self.counters["decode_beside_seconds"] += took
            self.pause.ran(took)
        return between

    def _chunks(self, batch: list[tuple[Request, int]]) -> tuple[list[SeqChunk], list[tuple]]:
        """The pass's sequences, and the anchor checkpoints it writes: (slot, the tokens before
        it, their KV blocks)."""
        chunks, writes = [], []
        for req, n in batch:
            start, tokens, draft = req.computed, req.tokens, req.draft
            snaps = []
            if self.anchors is not None:
                wanted = [p for p in req.anchor_plan if start < p <= start + n]
                if n - len(draft) == 1 and self.anchors.after_token(tokens[start]):   # a generated boundary token
                    wanted.append(start + 1)
                for p in wanted:
                    slot = self.anchors.reserve()
                    if slot is not None:
                        snaps.append((p, slot))
                        writes.append((slot, tokens[:p], self.anchors.blocks_of(req.blocks, p)))
            snaps += [(start + 1 + j, slot) for j, slot in enumerate(req.scratch)]   # after each draft token
            new = [tokens[start], *draft] if draft else tokens[start:start + n]
            chunks.append(SeqChunk(req.blocks, start, new, last=n - len(draft) == req.pending,
                                   state=req.state, snapshots=tuple(snaps), rows=1 + len(draft)))
        return chunks, writes

    def _pass(self, run: Callable, writes: list[tuple]):
        """``run()`` (a forward pass), then the anchor checkpoints it wrote are recorded (given
        up if it failed)."""
        try:
            out = run()
        except BaseException:
            for slot, _, blocks in writes:
                self.anchors.cancel(slot, blocks)
            raise
        for slot, tokens, blocks in writes:
            self.anchors.commit(slot, tokens, blocks)
        self.counters["anchor_checkpoints"] += len(writes)
        return out

    def _emit(self, batch: list[tuple[Request, int]], logits) -> None:
        """After a pass: advance each request, and sample, stream or retire those it completed
        (a drafted request: each token its draft's verification keeps, and the next one)."""
        first, ran = [0], [0]                 # each request's first row of ``logits``, of the pass
        for req, n in batch:
            first.append(first[-1] + 1 + len(req.draft))
            ran.append(ran[-1] + n)
        hidden = self.runner.model.last_hidden if self.mtp else None
        masked = constrained_rows(logits, {      # the rows this pass completes, under a grammar
            first[i]: req.guide for i, (req, n) in enumerate(batch)
            if req.guide is not None and req.guide.active and not req.draft and req.computed + n == len(req.tokens)})
        for i, (req, n) in enumerate(batch):
            start = req.computed
            req.computed += n - len(req.draft)
            self._share_prompt(req)
            if req.pending:
                self._record(req, start, hidden, ran[i])
                continue                      # prefill continues next step
            raw = logits[first[i]:first[i + 1]]
            rows = masked[first[i]][None] if first[i] in masked else raw
            lazy = req.guide is not None and bool(req.draft)   # a drafted row's mask follows the kept tokens
            try:
                self._walk(req, rows, lambda x: sample(req.guide.constrain(x) if lazy else x, req.params,
                                                       req.generator, req.penalties),
                           lambda j, tok: self._deliver(req, tok, raw[j]))
            except (NonFiniteLogits, InvalidRequest) as exc:   # this request's output is lost, the others go on
                log.warning("request %d: %s", req.id, exc)
                self._finish(req, "abort", error=exc)
            self._record(req, start, hidden, ran[i])

    def _deliver(self, req: Request, tok: int, raw: torch.Tensor) -> bool:
        """``req`` sampled ``tok`` from the logits ``raw [V]``: record and stream it, or retire the
        request with it; whether the request goes on."""
        params = req.params
        complete = req.guide is not None and req.guide.advance(tok)
        if req.penalties is not None:
            req.penalties.add(tok)
        lp = None if params.logprobs is None else token_logprobs(raw, tok, params.logprobs)
        req.output_ids.append(tok)
        self.counters["generated_tokens"] += 1
        if tok in req.stop_ids or complete:
            self._finish(req, "stop", tok, logprob=lp)
        elif len(req.output_ids) >= req.max_new_tokens:
            self._finish(req, "length", tok, logprob=lp)
        else:
            req.sink.push(TokenEvent(tok, None, logprob=lp))
            return True
        return False

    def _share_prompt(self, req: Request) -> None:
        """The prompt's full blocks join the prefix tree as they are computed, not when the
        request finishes: a request with the same prefix reuses them while this one still runs
        (an agent's side request beside its main one, sub-agents that start together, ``n``
        choices; ``Admission._admissible`` holds such a request back until they are there). A
        hybrid model's prompts are kept by their anchor checkpoints instead."""
        full = min(req.computed, len(req.prompt_ids)) // self.kv.block_size
        if full > req.shared and self.states is None:
            end = req.computed >= len(req.prompt_ids)
            self.radix.insert(req.prompt_ids, req.blocks[:full], end, self._marks(req.prompt_ids, full) if end else ())
            req.shared = full

    def _marks(self, tokens: list[int], full: int) -> tuple[int, ...]:
        """With a window store: the blocks before the first and the last turn boundary (an anchor
        token: cache/states.py) in ``tokens``' first ``full`` blocks, where a conversation that
        shares the system prompt, or an edited last turn, resumes."""
        if not self.kv.window:
            return ()
        ends = [p // self.kv.block_size for p, t in enumerate(tokens[:full * self.kv.block_size], 1)
                if t in self.window_anchor_ids]
        return (ends[0], ends[-1]) if ends else ()

    def _release(self, req: Request) -> None:
        self._undraft(req)
        if self.mtp and req.drafting is not None:
            req.drafting.reset()              # its rows run again when it is re-admitted
        self.kv.release(req.blocks)
        req.blocks = []
        if req.state >= 0:
            self.states.give(req.state)
            req.state = -1

    def _finish(self, req: Request, reason: str, last_token: int | None = None,
                error: Exception | None = None, logprob: tuple | None = None) -> None:
        if req in self.running:
            self.running.remove(req)
        full = req.computed // self.kv.block_size
        if full and self.states is None:    # a hybrid model's KV is kept by its anchor checkpoints
            self.radix.insert(req.tokens, req.blocks[:full], marks=self._marks(req.tokens, full))
        self._release(req)
        req.finished = True
        req.sink.push(TokenEvent(last_token, reason, error, logprob))

    def check_integrity(self) -> None:
        """Pool, tree and requests agree: every block a request holds is live."""
        self.kv.check_integrity()
        self.radix.check_integrity()
        for req in self.running:
            if any(self.kv.refs[b] < 1 for b in req.blocks):
                raise RuntimeError(f"request {req.id} holds a freed KV block")
            if self.kv.blocks_for(req.computed) > len(req.blocks):
                raise RuntimeError(f"request {req.id} computed past its blocks")


__all__ = ["Scheduler"]
