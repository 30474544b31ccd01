"""``LLM``: the offline Python API over one ``ModelRunner`` (one request at a time).

>>> llm = LLM("path/to/model", device="cpu")
>>> out = llm.generate(llm.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]),
...                    SamplingParams(max_new_tokens=16, temperature=0))
>>> out.token_ids, out.stats
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import EngineConfig
from .errors import InvalidRequest, RequestTooLong
from .executor.inputs import SeqChunk, build_inputs
from .executor.runner import ModelRunner
from .executor.sampler import SamplingParams, make_generator, make_guide, make_penalties, sample
from .executor.mtp import MtpSequence, catch_up
from .executor.speculate import NgramDrafter, SequenceDrafts, verify


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)


class LLM:
    def __init__(self, model: str | Path | None = None, **options):
        if model is None:
            from .models.default import default_model_dir
            model = default_model_dir(progress=True)
        self.config = EngineConfig(model=Path(model), **options)
        self.runner = ModelRunner(self.config)
        self.tokenizer = self.runner.tokenizer

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    def check_prompt(self, ids: list[int], max_new_tokens: int = 0) -> None:
        vocab = self.runner.mcfg.vocab_size
        if not ids:
            raise InvalidRequest("the prompt is empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if len(ids) + max_new_tokens > self.max_context:
            plus = f" plus {max_new_tokens} new tokens" if max_new_tokens else ""
            raise RequestTooLong(f"prompt of {len(ids)} tokens{plus} exceeds the context of {self.max_context}")

    def _slot(self) -> int:
        """A recurrent-state slot for a sequence of a hybrid model (-1: the model has none)."""
        return self.runner.states.take() if self.runner.states is not None else -1

    def _release(self, blocks: list[int], slot: int) -> None:
        """A sequence's KV blocks and state slot back to their pools, and torch's thread count
        back to the caller's (a CPU engine's decode passes ran on one: executor/host_threads.py)."""
        self.runner.kv.release(blocks)
        blocks.clear()
        if slot >= 0:
            self.runner.states.give(slot)
        if self.runner.host_threads is not None:
            self.runner.host_threads.restore()

    def _run(self, ids: list[int], chunk: int | None = None, slot: int = -1, after=None):
        """Prefill ``ids`` in chunks into fresh KV blocks (and state ``slot``); return (blocks,
        logits of the last token). ``after(blocks, start, n)`` follows each chunk's pass."""
        kv = self.runner.kv
        blocks: list[int] = []
        start = 0
        chunk = chunk or self.config.prefill_tokens
        logits = None
        while start < len(ids):
            piece = ids[start:start + chunk]
            kv.extend(blocks, start + len(piece))
            logits = self.runner.forward([SeqChunk(blocks, start, piece, last=start + len(piece) == len(ids),
                                                   state=slot)])[0]
            if after is not None:
                after(blocks, start, len(piece))
            start += len(piece)
        return blocks, logits

    @torch.inference_mode()
    def forward_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits ``[T, V]`` (float32) for every position of ``ids``, one position at a time after
        the first token (so they exercise the KV cache and the decode path)."""
        self.check_prompt(ids)
        kv = self.runner.kv
        blocks, rows, slot = [], [], self._slot()
        try:
            for pos, tok in enumerate(ids):
                kv.extend(blocks, pos + 1)
                rows.append(self.runner.forward([SeqChunk(blocks, pos, [tok], state=slot)])[0])
        finally:
            self._release(blocks, slot)
        return torch.stack(rows)

    @torch.inference_mode()
    def prefill_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits ``[T, V]`` of one whole-prompt forward pass (the prefill path)."""
        self.check_prompt(ids)
        kv = self.runner.kv
        blocks, slot = kv.allocate(kv.blocks_for(len(ids))), self._slot()
        try:
            kv.before_pass([(blocks, 0, len(ids), len(ids))])
            inp = build_inputs([SeqChunk(blocks, 0, ids, state=slot)], kv.block_size, self.runner.device)
            inp.logits_at = torch.arange(len(ids), device=self.runner.device)
            return self.runner.model(inp.ids, inp.batch, kv, inp.logits_at)
        finally:
            self._release(blocks, slot)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Generation:
        params = params or SamplingParams()
        self.check_prompt(prompt_ids, 0)
        max_new = min(params.max_new_tokens, self.max_context - len(prompt_ids))
        if max_new < 1:
            raise RequestTooLong(f"prompt of {len(prompt_ids)} tokens fills the context of {self.max_context}")
        gen = make_generator(params, self.config.seed)
        guide = make_guide(params, self.runner.tokenizer, self.runner.mcfg.vocab_size)
        penalties = make_penalties(params, prompt_ids, self.runner.mcfg.vocab_size)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.runner.eos_token_ids))
        kv = self.runner.kv
        t0 = time.perf_counter()
        slot = self._slot()
        drafts = _Drafts(self, prompt_ids)
        try:
            blocks, logits = self._run(prompt_ids, slot=slot, after=drafts.prefilled)
        except BaseException:
            drafts.close()
            self._release([], slot)
            raise
        t1 = time.perf_counter()
        out, finish = [], "length"
        rows, draft, passes = logits[None], [], 0

        def choose(x: torch.Tensor) -> int:
            return sample(x if guide is None else guide.constrain(x), params, gen, penalties)
        try:
            going = True
            while going:
                kept = 0
                for _, tok, ok in verify(rows, draft, choose):
                    if penalties is not None:
                        penalties.add(tok)
                    out.append(tok)
                    kept += ok
                    if tok in stop or (guide is not None and guide.advance(tok)):
                        finish, going = "stop", False
                        break
                    if len(out) >= max_new:
                        going = False
                        break
                drafts.kept(kept, len(draft), slot)
                if going:
                    pos = len(prompt_ids) + len(out) - 1
                    draft = drafts.propose(out, max_new - len(out) - 1, blocks, pos)
                    kv.extend(blocks, pos + 1 + len(draft))
                    rows = self.runner.forward([SeqChunk(blocks, pos, [tok, *draft], state=slot, rows=1 + len(draft),
                                                         snapshots=drafts.snapshots(pos, len(draft)))])
                    drafts.passed(pos)
                    passes += 1
        finally:
            drafts.close()
            self._release(blocks, slot)
        t2 = time.perf_counter()
        decode_steps = max(len(out) - 1, 0)
        stats = {"prompt_tokens": len(prompt_ids), "generated_tokens": len(out),
                 "prefill_tokens_per_s": len(prompt_ids) / max(t1 - t0, 1e-9),
                 "decode_tokens_per_s": decode_steps / max(t2 - t1, 1e-9) if decode_steps else 0.0,
                 "expert_cache": self.runner.expert_stats()}
        stats.update({k: stats["expert_cache"][k] for k in ("hits", "misses", "fills", "cpu_computed")})
        stats.update(decode_passes=passes, draft_tokens=drafts.drafted, draft_tokens_kept=drafts.kept_tokens)
        stats["capacity"] = stats["expert_cache"]["capacity_experts"]
        return Generation(out, finish, stats)


class _Drafts:
    """One ``generate`` call's speculative drafts (``executor/speculate.py``, or the MTP head's:
    ``executor/mtp.py``): proposals, the snapshot slots of a hybrid model's state after each
    draft token, and the state restored when a draft is cut short."""

    def __init__(self, llm: LLM, prompt_ids: list[int]):
        cfg, self.states, self.runner = llm.config, llm.runner.states, llm.runner
        on = cfg.speculative_tokens > 0
        self.prompt_ids = prompt_ids
        self.mtp = MtpSequence(cfg.speculative_tokens) if on and cfg.speculative_method == "mtp" else None
        self.draft_vocab = cfg.speculative_draft_vocab
        self.seq = (SequenceDrafts(NgramDrafter(cfg.speculative_tokens, *cfg.speculative_ngram), prompt_ids)
                    if on and self.mtp is None else None)
        self.scratch = self.states.take_scratch(cfg.speculative_tokens) if on and self.states is not None else []
        self.drafted = self.kept_tokens = 0
        self._pass: tuple[int, torch.Tensor] | None = None   # the last decode pass: its start, hidden states

    def prefilled(self, blocks: list[int], start: int, n: int) -> None:
        """A prompt chunk's pass ran: the MTP layer runs its rows (all but a last one, whose next
        token is not sampled yet)."""
        if self.mtp is not None:
            self.mtp.record(start, self.runner.model.last_hidden[:n])
            catch_up(self.runner, [(self.mtp, blocks, self.prompt_ids, [])])

    def passed(self, pos: int) -> None:
        if self.mtp is not None:
            self._pass = (pos, self.runner.model.last_hidden)

    def propose(self, out: list[int], limit: int, blocks: list[int], pos: int) -> list[int]:
        """At most ``limit`` draft tokens after ``out``'s last token (position ``pos``)."""
        if limit < 1:
            return []
        if self.mtp is not None:
            if self._pass is not None:         # the last pass's kept rows, then the MTP layer over them
                start, hidden = self._pass
                self.mtp.record(start, hidden[:pos - start])
                self._pass = None
            catch_up(self.runner, [(self.mtp, blocks, self.prompt_ids, out)])
            self.runner.kv.extend(blocks, pos + limit)       # the guesses' KV
            draft = self.mtp.propose(self.runner, blocks, pos, limit, self.draft_vocab)
        elif self.seq is not None:
            draft = self.seq.propose(out, limit)
        else:
            return []
        if self.states is not None:
            draft = draft[:len(self.scratch)]
        self.drafted += len(draft)
        return draft

    def snapshots(self, pos: int, n: int) -> tuple[tuple[int, int], ...]:
        return tuple((pos + 1 + j, self.scratch[j]) for j in range(n)) if self.states is not None else ()

    def kept(self, kept: int, drafted: int, slot: int) -> None:
        self.kept_tokens += kept
        for seq in (self.seq, self.mtp):
            if seq is not None:
                seq.update(drafted, kept)
        if kept < drafted and self.states is not None:
            self.states.copy(self.scratch[kept], slot)

    def close(self) -> None:
        if self.scratch:
            self.states.give_scratch(self.scratch)
            self.scratch = []


class Lockstep:
    """Greedy decode of several prompts together, one forward pass per step for the whole batch
    (the batches the scheduler forms for concurrent requests, without its queue): for tests and
    benchmarks of batched decode. ``step()`` -> logits [B, V] and each prompt's next token."""

    def __init__(self, llm: LLM, prompts: list[list[int]]):
        self.llm, self.runner, self.kv = llm, llm.runner, llm.runner.kv
        self.seqs: list[tuple[list[int], int, list[int], int]] = []  # (KV blocks, prompt length, new tokens, state)
        for p in prompts:
            llm.check_prompt(p)
            slot = llm._slot()
            blocks, logits = llm._run(p, slot=slot)
            self.seqs.append((blocks, len(p), [int(logits.argmax())], slot))

    @property
    def tokens(self) -> list[list[int]]:
        return [s[2] for s in self.seqs]

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        chunks = []
        for blocks, n, out, slot in self.seqs:
            pos = n + len(out) - 1
            self.kv.extend(blocks, pos + 1)
            chunks.append(SeqChunk(blocks, pos, [out[-1]], state=slot))
        logits = self.runner.forward(chunks)
        for s, tok in zip(self.seqs, logits.argmax(-1).tolist()):
            s[2].append(tok)
        return logits

    def close(self) -> None:
        """Release the KV blocks and state slots (the tokens stay readable)."""
        for blocks, _, _, slot in self.seqs:
            if blocks:
                self.llm._release(blocks, slot)
