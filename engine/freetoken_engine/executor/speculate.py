"""Speculative decoding with n-gram drafts (prompt lookup): exact, for any model.

A request's next tokens are often already in its context: a coding agent re-emits the code it
read, an edit repeats the file around the change, a tool call names the paths of its prompt.
``NgramDrafter.propose`` finds the latest earlier occurrence of the sequence's last n tokens
(the longest n from ``max_n`` down to ``min_n``) and proposes the tokens that followed it. The
next pass runs the last token and the draft together (``SeqChunk.rows``: logits for each of
them), and ``verify`` walks those logits in order: position j's token is sampled exactly as a
plain decode step would sample it (same mask, penalties and random draw, in the same order),
and the walk goes on only while that token equals draft j. So the output is the one a plain
decode gives, token for token, greedy or seeded; a draft only saves passes. (For a one-token
draft distribution, sampling the target and comparing is exactly speculative rejection
sampling: the draft is kept with probability p(d), else the token comes from p without d.)

What a rejected draft leaves behind is undone by its owner: the KV positions past the kept
tokens are simply overwritten later (``computed`` does not count them), and a hybrid model's
recurrent state is restored from the snapshot taken after the last kept token
(``StatePool.scratch``).

A pass of k + 1 tokens costs about one token's pass where decode reads weights at memory
bandwidth (every expert of a layer is read once for all of them), so each kept draft token is
nearly free; under expert offload each position may add experts to fetch or compute, which
``bench/speculative.py`` measures.
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch


class TokenHistory:
    """A sequence's tokens as a growing int array, for drafting."""

    def __init__(self, tokens: list[int]):
        self._buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self._n = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._n

    def extend(self, tokens: list[int]) -> None:
        need = self._n + len(tokens)
        if need > len(self._buf):
            grown = np.empty(2 * need, dtype=np.int64)
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown
        self._buf[self._n:need] = tokens
        self._n = need

    @property
    def array(self) -> np.ndarray:
        return self._buf[:self._n]


class NgramDrafter:
    """Prompt-lookup drafts of up to ``tokens`` tokens from n-gram matches of ``min_n..max_n``."""

    def __init__(self, tokens: int, min_n: int = 2, max_n: int = 4):
        if tokens < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"speculative drafts need tokens >= 1 and 1 <= min_n <= max_n, got "
                             f"{tokens}, {min_n}, {max_n}")
        self.tokens, self.min_n, self.max_n = tokens, min_n, max_n

    def propose(self, history: np.ndarray, limit: int | None = None) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest suffix of
        ``history`` (``min_n``..``max_n`` tokens) found before; at most ``limit`` (default
        ``tokens``); [] when no such suffix recurs. One vectorised scan of the history."""
        k = self.tokens if limit is None else min(limit, self.tokens)
        n_hist = len(history)
        if k < 1 or n_hist <= self.min_n:
            return []
        cand = np.flatnonzero(history[:n_hist - 1] == history[n_hist - 1])   # ends of 1-token matches
        found = 1
        for n in range(2, self.max_n + 1):
            if n >= n_hist or not cand.size:
                break
            room = cand[cand >= n - 1]
            longer = room[history[room - (n - 1)] == history[n_hist - n]]
            if not longer.size:
                break
            cand, found = longer, n
        if found < self.min_n or not cand.size:
            return []
        at = int(cand[-1]) + 1
        return history[at:at + k].tolist()


class DraftLength:
    """How long a sequence's next draft may be: after a draft cut short at ``kept`` tokens, one
    more than were kept; after a draft kept whole, twice as long, up to ``most``. Text that the
    context does not predict (short chance matches, refused at once) then costs a one-token
    draft per pass instead of ``most``, and a refused one-token draft pauses drafting for 1, 2,
    4 ... up to ``MAX_PAUSE`` steps (a kept token ends the pause): where a verification row
    costs more than it saves (the CPU's eager path) such text runs at about plain speed; a
    passage being copied soon drafts ``most`` again."""

    MAX_PAUSE = 16

    def __init__(self, most: int):
        self.most = self.now = most
        self.pause = self.wait = 0

    def next(self) -> int:
        """The longest draft this step (0: none, paused)."""
        if self.wait:
            self.wait -= 1
            return 0
        return self.now

    def update(self, drafted: int, kept: int) -> None:
        if not drafted:
            return
        self.now = min(self.most, 2 * self.now) if kept == drafted else max(1, kept + 1)
        if kept:
            self.pause = 0
        elif drafted == 1:
            self.pause = min(self.MAX_PAUSE, max(1, 2 * self.pause))
            self.wait = self.pause


class SequenceDrafts:
    """One sequence's drafting state, for the scheduler and ``LLM.generate`` alike: its tokens as
    an array (caught up with its output at each proposal) and its ``DraftLength``."""

    def __init__(self, drafter: NgramDrafter, prompt_ids: list[int]):
        self.drafter, self.prompt_len = drafter, len(prompt_ids)
        self.history = TokenHistory(prompt_ids)
        self.length = DraftLength(drafter.tokens)

    def propose(self, output_ids: list[int], limit: int) -> list[int]:
        """A draft of at most ``limit`` tokens after the prompt and ``output_ids``."""
        self.history.extend(output_ids[len(self.history) - self.prompt_len:])
        return self.drafter.propose(self.history.array, min(limit, self.length.next()))

    def update(self, drafted: int, kept: int) -> None:
        self.length.update(drafted, kept)


def verify(logits: torch.Tensor, draft: list[int], choose: Callable[[torch.Tensor], int]
           ) -> Iterator[tuple[int, int, bool]]:
    """Walk a verification pass: ``logits [len(draft) + 1, V]`` are the rows after the last
    token and after each draft token. Yields ``(j, token, kept)`` per position, sampling with
    ``choose`` in order; stops after the first token that differs from the draft (it is the
    correction, or after a fully kept draft the bonus token). The caller stops earlier at a stop
    token or a length limit."""
    for j in range(len(draft) + 1):
        tok = choose(logits[j])
        kept = j < len(draft) and tok == draft[j]
        yield j, tok, kept
        if not kept:
            return


__all__ = ["DraftLength", "NgramDrafter", "SequenceDrafts", "TokenHistory", "verify"]
