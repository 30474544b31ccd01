"""Repetition penalties, as OpenAI and vLLM define them, kept per request in O(1) a token.

- ``presence_penalty`` p and ``frequency_penalty`` f (OpenAI, -2..2): a token generated c times
  so far loses ``c * f + (c > 0) * p`` from its logit. Only the output counts.
- ``repetition_penalty`` r (vLLM and transformers, > 0): a token in the prompt or the output has
  its logit divided by r when positive, multiplied by r when negative.

Qwen's model cards recommend ``presence_penalty`` up to 1.5-2 against endless repetition.
``Penalties`` holds the counts and the seen set as ``[V]`` tensors (built once from the prompt,
then one update per sampled token); its owner (the scheduler thread or ``LLM.generate``) calls
``add`` after each sample.
"""
from __future__ import annotations

import torch


class Penalties:
    def __init__(self, params, prompt_ids: list[int], n_vocab: int):
        self.presence, self.frequency = params.presence_penalty, params.frequency_penalty
        self.repetition = params.repetition_penalty
        self.counts = torch.zeros(n_vocab)                  # output occurrences  [V]
        self.seen = torch.zeros(n_vocab, dtype=torch.bool)  # prompt or output    [V]
        if self.repetition != 1.0 and prompt_ids:
            self.seen[torch.tensor(prompt_ids, dtype=torch.long)] = True

    @staticmethod
    def wanted(params) -> bool:
        return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)

    def add(self, token: int) -> None:
        if 0 <= token < self.counts.numel():
            self.counts[token] += 1
            self.seen[token] = True

    def apply(self, x: torch.Tensor) -> None:
        """Penalise ``x [V]`` (float32, CPU) in place."""
        if self.repetition != 1.0:
            r = torch.where(x > 0, 1.0 / self.repetition, self.repetition)
            x.copy_(torch.where(self.seen, x * r, x))
        if self.presence or self.frequency:
            x -= self.counts * self.frequency + (self.counts > 0) * self.presence


__all__ = ["Penalties"]
