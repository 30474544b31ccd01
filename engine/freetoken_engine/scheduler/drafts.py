"""The scheduler's side of speculative decoding (``executor/speculate.py``): a decoding request
gets an n-gram draft when its step is scheduled, the pass verifies it, and ``_walk`` keeps the
tokens that agree.

A draft never costs another request anything: it only takes KV blocks that are free (no eviction,
no preemption) and, on a hybrid model, snapshot slots that are free (``StatePool.scratch``); it
stops before an anchor token (so the anchors' checkpoints are taken where they would be without
drafts) and within the request's length limit; only steps with at most ``draft_decoders``
decoding requests draft. With ``--speculative-method mtp`` the drafts come from the model's
MTP head instead (``executor/mtp.py``): every pass's rows are recorded (``_record``) and the MTP
layer runs over them after each step (``_catch_up``). A request under a grammar gets its masks row by
row as its draft is walked (each after the tokens kept before it); decode steps taken beside a
long prefill go without drafts. Mixed into ``Scheduler``; runs on the scheduler thread.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..executor.mtp import MtpSequence, catch_up, propose_all
from ..executor.speculate import NgramDrafter, SequenceDrafts, verify
from .request import Request


class Drafts:
    drafter: NgramDrafter | None

    def _init_drafts(self, tokens: int, ngram: tuple[int, int], most_decoders: int = 1, method: str = "ngram") -> None:
        self.drafter = NgramDrafter(tokens, *ngram) if tokens else None
        self.mtp = bool(tokens) and method == "mtp"     # drafts from the model's MTP head (executor/mtp.py)
        self._mtp_ready: dict[int, list[int]] = {}       # this step's MTP drafts, by sequence state
        self.draft_decoders = most_decoders
        self.counters.update(draft_tokens=0, draft_tokens_kept=0, draft_steps=0)

    def _record(self, req: Request, start: int, hidden: torch.Tensor | None, row: int) -> None:
        """MTP drafts: the rows ``req`` ran from position ``start`` in the last pass and kept
        (``hidden``: that pass's final hidden states, ``req``'s from ``row``) wait for the MTP
        layer."""
        if not self.mtp or req.finished or req not in self.running:
            return
        if req.drafting is None:
            req.drafting = MtpSequence(self.drafter.tokens)
        req.drafting.record(start, hidden[row:row + req.computed - start])

    def _catch_up(self) -> None:
        """MTP drafts: one pass of the MTP layer over every running request's recorded rows."""
        if self.mtp:
            catch_up(self.runner, [(r.drafting, r.blocks, r.prompt_ids, r.output_ids) for r in self.running
                                   if r.drafting is not None and r.drafting.rows])

    def _with_drafts(self, batch: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """The step's batch with drafts for its decoding requests, when there are at most
        ``draft_decoders`` of them (``--speculative-max-batch``): a batch already reads each
        weight once for all its rows, and every verification row adds compute. On the 2-CPU VM
        four requests drafting made the steps 0.67-0.92x as fast (0.80-0.85x sharing K draft
        tokens a step), while one alone gains 1.5-3.4x."""
        if self.drafter is None or sum(r.pending == 1 for r, _ in batch) > self.draft_decoders:
            return batch
        if self.mtp:
            self._mtp_drafts([r for r, _ in batch if r.pending == 1])
        return [(r, n + self._draft(r)) if r.pending == 1 else (r, n) for r, n in batch]

    def _room(self, req: Request) -> int:
        """The longest draft ``req`` may have: within its length limits and the free KV blocks."""
        room = min(req.max_new_tokens - len(req.output_ids) - 1, self.runner.max_context - req.computed - 1)
        return min(room, (len(req.blocks) + self.kv.free_blocks) * self.kv.block_size - req.computed - 1)

    def _mtp_drafts(self, decoders: list[Request]) -> None:
        """The MTP head's drafts of every decoding request of the step, made together (their
        guesses' KV blocks taken first); ``_propose`` hands them out."""
        items = []
        for req in decoders:
            room = self._room(req)
            if req.drafting is None or room < 1:
                continue
            grow = self.kv.blocks_for(req.computed + room) - len(req.blocks)
            if grow > 0:
                req.blocks += self.kv.allocate(grow)
            items.append((req.drafting, req.blocks, req.computed, room))
        drafts = propose_all(self.runner, items, self.runner.cfg.speculative_draft_vocab)
        self._mtp_ready = {id(s): d for (s, *_), d in zip(items, drafts)}

    def _draft(self, req: Request) -> int:
        """Give ``req`` (decoding, its next KV block already held) a draft for this step; its length."""
        if self.drafter is None:
            return 0
        room = self._room(req)
        if room < 1:
            return 0
        draft = self._propose(req, room)
        if self.anchors is not None:
            cut = next((j for j, t in enumerate(draft) if self.anchors.after_token(t)), len(draft))
            draft = draft[:cut]
        if draft and self.states is not None:
            req.scratch = self.states.take_scratch(len(draft))
            draft = draft[:len(req.scratch)]
        if not draft:
            return 0
        grow = self.kv.blocks_for(req.computed + 1 + len(draft)) - len(req.blocks)
        if grow > 0:
            req.blocks += self.kv.allocate(grow)
        req.draft = draft
        self.counters["draft_tokens"] += len(draft)
        self.counters["draft_steps"] += 1
        return len(draft)

    def _propose(self, req: Request, room: int) -> list[int]:
        """At most ``room`` draft tokens for ``req``: the MTP head's (``_mtp_drafts``), or the
        n-gram lookup's."""
        if self.mtp:
            return self._mtp_ready.pop(id(req.drafting), [])[:room] if req.drafting is not None else []
        if req.drafting is None:
            req.drafting = SequenceDrafts(self.drafter, req.prompt_ids)
        return req.drafting.propose(req.output_ids, room)

    def _undraft(self, req: Request) -> None:
        """Drop ``req``'s draft (before its pass, or after it: its snapshot slots go back)."""
        req.draft = []
        if req.scratch:
            self.states.give_scratch(req.scratch)
            req.scratch = []

    def _walk(self, req: Request, logits: torch.Tensor, choose: Callable[[torch.Tensor], int],
              take: Callable[[int, int], bool]) -> None:
        """Sample ``req``'s tokens from its rows ``logits [1 + len(draft), V]``: ``take(row,
        token)`` delivers each and says whether the request goes on. A kept draft token's KV counts
        as computed; a cut-short draft on a hybrid model restores the state after the last kept
        token."""
        draft, kept = req.draft, 0
        for j, tok, ok in verify(logits, draft, choose):
            if ok:
                req.computed += 1
                kept += 1
                self.counters["draft_tokens_kept"] += 1
            if not take(j, tok):
                return
        if draft:
            req.drafting.update(len(draft), kept)
        if kept < len(draft) and req.scratch:
            self.states.copy(req.scratch[kept], req.state)
        self._undraft(req)


__all__ = ["Drafts"]
