"""Speculative drafts from the checkpoint's own multi-token-prediction layer (``--speculative-method
mtp``): Qwen3-Next and Qwen3.5/3.6 ship one (``mtp.*``, ``models/decoder.MtpHead``), trained with
the model to predict the token after next. The engine runs it frozen, as it ships.

Every pass of the model leaves each row's final hidden state (``DecoderLM.last_hidden``). Once
the token after a row is known (the next prompt token, or the one sampled there) the row is
``record``-ed, and ``catch_up`` runs the MTP layer over a sequence's recorded rows in one pass:
row i takes the model's hidden state at position i and the embedding of token i + 1, writes the
MTP layer's KV at position i, and the head's output at the last row predicts the token after the
last sampled one. ``propose`` turns that into a draft: the first token is the argmax of the LM
head on it; each further token feeds the head its own output and its own last guess at the next
position (the MTP layer's KV there is a guess too, overwritten when the real rows catch up).
The draft is verified like any other (``executor/speculate.verify``), so the output is the plain
decode's whatever the head predicts; the head only decides how many passes are saved.
"""
from __future__ import annotations

import torch

from .inputs import SeqChunk
from .speculate import DraftLength


class MtpSequence:
    """One sequence's MTP state: the rows the model has run and the MTP layer has not (their
    first position and hidden states), the head's output after the last row it has run
    (``head``, at position ``at``), and the draft length (``DraftLength``)."""

    def __init__(self, most: int):
        self.length = DraftLength(most)
        self.reset()

    def reset(self) -> None:
        """Forget everything (the sequence's KV is recomputed from ``computed = 0`` or a cached
        prefix: its rows are recorded again as they run)."""
        self.start, self.rows = 0, []
        self.head: torch.Tensor | None = None
        self.at = -1

    @property
    def pending(self) -> int:
        return sum(len(r) for r in self.rows)

    def record(self, start: int, hidden: torch.Tensor) -> None:
        """The model ran positions ``start ..`` with final hidden states ``hidden [n, H]`` (copied:
        a decode graph reuses its buffer). Rows that do not follow the recorded ones (the sequence
        was recomputed from another point) replace them."""
        if not len(hidden):
            return
        if self.rows and start != self.start + self.pending:
            self.rows = []
        if not self.rows:
            self.start = start
        self.rows.append(hidden.clone())

    def update(self, drafted: int, kept: int) -> None:
        self.length.update(drafted, kept)

    def propose(self, runner, blocks: list[int], computed: int, limit: int, vocab: int = 0) -> list[int]:
        """A draft of at most ``limit`` tokens after the token at position ``computed`` (sampled,
        not yet run), once the MTP layer has run every row before it; ``blocks`` must cover
        ``computed + limit - 1`` positions (the guesses' KV). [] when not caught up."""
        return propose_all(runner, [(self, blocks, computed, limit)], vocab)[0]

    def wanted(self, computed: int, limit: int) -> int:
        """How long a draft this sequence makes now (``DraftLength``; 0: none, or not caught up)."""
        if self.head is None or self.at != computed - 1 or self.rows:
            return 0
        return max(0, min(limit, self.length.next()))


@torch.inference_mode()
def propose_all(runner, items: list[tuple[MtpSequence, list[int], int, int]], vocab: int = 0) -> list[list[int]]:
    """``MtpSequence.propose`` for several sequences ``(sequence, KV blocks, computed, limit)`` at
    once: the LM head over their heads together, then each further draft token of all those
    still drafting in one pass of the MTP layer. ``vocab``: draft among the first ``vocab`` token
    ids only (``--speculative-draft-vocab``; 0: all), a slice of the LM head's rows: BPE vocabularies
    number their tokens in merge order, most frequent first, and the LM head over a 150-250k
    vocabulary is most of an MTP pass's bytes."""
    model = runner.model
    want = [s.wanted(computed, limit) for s, _, computed, limit in items]
    drafts: list[list[int]] = [[] for _ in items]
    live = [i for i, n in enumerate(want) if n > 0]
    if not live:
        return drafts
    h = torch.stack([items[i][0].head for i in live])
    for j in range(max(want)):
        if j:
            h = runner.mtp_forward([SeqChunk(items[i][1], items[i][2] + j - 1, [drafts[i][-1]]) for i in live], h)
        for i, tok in zip(live, model.logits(h, vocab).argmax(-1).tolist()):
            drafts[i].append(tok)
        keep = [r for r, i in enumerate(live) if want[i] > j + 1]
        if len(keep) < len(live):
            live = [live[r] for r in keep]
            if not live:
                break
            h = h[keep]
    return drafts


def _span(prompt: list[int], output: list[int], a: int, b: int) -> list[int]:
    """``(prompt + output)[a:b]`` without joining the two."""
    p = len(prompt)
    return prompt[a:b] + output[max(0, a - p):max(0, b - p)] if a < p else output[a - p:b - p]


@torch.inference_mode()
def catch_up(runner, seqs: list[tuple[MtpSequence, list[int], list[int], list[int]]]) -> None:
    """Run the MTP layer over the recorded rows of every ``(sequence, KV blocks, prompt, output)``
    whose next token is known (row at position p takes token p + 1 of prompt + output), in one
    pass; rows whose next token is not known yet stay recorded."""
    chunks, hidden, ran = [], [], []
    for s, blocks, prompt, output in seqs:
        n = min(s.pending, len(prompt) + len(output) - s.start - 1)
        if n < 1:
            continue
        rows = torch.cat(s.rows) if len(s.rows) > 1 else s.rows[0]
        chunks.append(SeqChunk(blocks, s.start, _span(prompt, output, s.start + 1, s.start + 1 + n)))
        hidden.append(rows[:n])
        ran.append((s, n, rows))
    if not chunks:
        return
    heads = runner.mtp_forward(chunks, torch.cat(hidden) if len(hidden) > 1 else hidden[0])
    for i, (s, n, rows) in enumerate(ran):
        s.head, s.at = heads[i], s.start + n - 1
        s.rows = [rows[n:]] if n < len(rows) else []
        s.start += n


__all__ = ["MtpSequence", "catch_up", "propose_all"]
