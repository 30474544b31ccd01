"""Admission: which waiting requests join the running batch, and where their KV starts.

A request is admitted in arrival order while the batch and the KV pool allow (a constrained one
whose grammar tables are still being built waits, and those behind it go ahead). Its prompt
resumes from the longest cached prefix in the radix tree, or for a hybrid model from its
deepest anchor checkpoint (a shared partial block is copied). Unlocked tree leaves, then anchor
checkpoints, give their KV back when the pool is short. Mixed into ``Scheduler``: everything
here runs on the scheduler thread and uses its state (``waiting``, ``running``, ``kv``,
``radix``, ``states``, ``anchors``, ``counters``).
"""
from __future__ import annotations

import logging

from ..errors import InvalidRequest, OutOfKVCache
from ..executor.guide import Guide, tables_ready
from .request import Request, TokenEvent

log = logging.getLogger(__name__)


class Admission:
    def _free_blocks(self, n: int) -> bool:
        if self.kv.free_blocks < n:
            self.radix.evict(n - self.kv.free_blocks)
        while self.kv.free_blocks < n and self.anchors is not None and self.anchors.drop_oldest():
            pass                          # anchor checkpoints give their KV back, oldest first
        return self.kv.free_blocks >= n

    def _admissible(self, req: Request) -> bool:
        """Whether ``req`` may start now; those behind a request that may not go ahead. It waits
        while a running request is still prefilling a full block their prompts share (the
        block joins the prefix tree when computed, so it is not computed twice), and a
        constrained request waits until the grammar engine's tables for the tokenizer are built
        (``guide.tables_ready``: once per process)."""
        if self._behind_a_prefill(req):
            return False
        if req.params.guide is None or req.guide is not None:
            return True
        return tables_ready(self.runner.tokenizer, self.runner.mcfg.vocab_size)

    def _behind_a_prefill(self, req: Request) -> bool:
        if self.states is not None:
            return False
        bs, prompt = self.kv.block_size, req.prompt_ids
        for other in self.running:
            next_block = other.computed // bs          # the next full block it will compute
            end = (next_block + 1) * bs
            if (next_block < len(other.prompt_ids) // bs and len(prompt) >= end
                    and prompt[:end] == other.prompt_ids[:end]):
                return True
        return False

    def _admit(self) -> None:
        while len(self.running) < self.max_batch:
            with self._cv:
                waiting = list(self.waiting)    # judged outside the lock: ``add`` never waits on it
            req = next((r for r in waiting if self._admissible(r)), None)
            if req is None:
                return
            if req.params.guide is not None and req.guide is None:
                try:
                    req.guide = Guide(req.params.guide, self.runner.tokenizer, self.runner.mcfg.vocab_size)
                except InvalidRequest as exc:   # the tables could not be built for this tokenizer
                    with self._cv:
                        self.waiting.remove(req)
                    req.sink.push(TokenEvent(None, "abort", exc))
                    continue
            tokens = req.tokens
            resume, ck, matched = self._resume_point(tokens)
            keep, tail = divmod(resume, self.kv.block_size)
            src, matched = (matched[keep] if tail else None), matched[:keep]
            need = self.kv.blocks_for(len(tokens)) - len(matched)
            if not self._free_blocks(need):
                self.kv.release(matched + ([src] if tail else []))
                if not self.running:     # alone and still too big: it can never run
                    with self._cv:
                        self.waiting.remove(req)
                    error = OutOfKVCache(f"the request needs {need} KV blocks of {self.kv.block_size} "
                                         f"tokens; the KV cache holds {self.kv.num_blocks}: shorten it")
                    req.sink.push(TokenEvent(None, "abort", error))
                    log.warning("request %d: %s", req.id, error)
                return
            with self._cv:
                self.waiting.remove(req)
            req.blocks = matched + self.kv.allocate(need)
            if tail:        # the resume point's block is shared: its first ``tail`` slots are copied
                self.kv.copy_prefix(src, req.blocks[keep], tail)
                self.kv.release([src])
            req.computed = resume
            if self.states is not None:
                req.state = self.states.take()
                if ck is not None:
                    self.states.copy(ck, req.state)
                    self.counters["anchor_resumes"] += 1
                    self.counters["anchor_resumed_tokens"] += resume
                if self.anchors is not None:
                    req.anchor_plan = self.anchors.plan(tokens, len(req.prompt_ids), resume)
            if not req.output_ids:       # first admission (not a re-admission after preemption)
                req.cached_tokens = req.computed
                req.sink.prompt_tokens, req.sink.cached_tokens = len(req.prompt_ids), req.computed
                self.counters["prompt_tokens"] += len(req.prompt_ids)
                self.counters["cached_tokens"] += req.computed
            self.running.append(req)

    def _resume_point(self, tokens: list[int]) -> tuple[int, int | None, list[int]]:
        """Where a request starts, the checkpoint whose state it starts from, and the KV blocks of
        what it skips (a reference held for it; the last one partly, from a checkpoint): the
        longest cached prefix in the tree for an attention-only model; for a hybrid one, whose
        KV is no use without the state, the deepest anchor checkpoint (0, none: the start)."""
        if self.states is None:
            matched = self.radix.match(tokens, len(tokens) - 1)
            usable = self.kv.resumable(matched)     # a window store may have let older keys go
            self.kv.release(matched[usable:])
            return usable * self.kv.block_size, None, matched[:usable]
        if self.anchors is None:
            return 0, None, []
        resume, ck, blocks = self.anchors.best(tokens, len(tokens) - 1)
        return resume, ck, self.anchors.blocks_of(blocks, resume)
