"""Constrained decoding: a request's output follows a grammar (a JSON Schema, a regex, a lark
grammar), by masking the tokens the grammar forbids before each sample.

The grammar engine is llguidance (the one vLLM, SGLang and llama.cpp use): it compiles the
grammar lazily against the tokenizer and computes each step's allowed-token bitmask in tens of
microseconds, so no compile step delays the first token.

``GuideSpec`` (frozen, inside ``SamplingParams``) is what a request asks for; ``Guide`` is one
request's live state, owned by whoever samples for it (the scheduler thread, or ``LLM.generate``).
A spec can leave room for what surrounds the constrained answer in a chat model's output:

- ``reasoning``: the output starts inside a reasoning block (the template opened ``<think>``);
  it is free until ``close_reasoning`` is sampled, then the grammar applies (after up to
  ``GAP_TOKENS`` whitespace tokens).
- ``open_reasoning``: where the grammar would start, this token is allowed too and opens a
  reasoning block (models that decide to think, Qwen3).
- ``escape``: where the grammar would start, these tokens are allowed too and end the
  constraint (a tool call's opening tag: with ``tool_choice="auto"`` the model may call a tool
  instead of answering).
- ``tool_grammar``: each tool call, from after its opening tag to its closing one, follows this
  grammar (names one of the tools, arguments valid for its schema); ``in_tool``: the output
  starts inside a tool call the prompt opened (``tool_choice`` required or named); that
  grammar is the whole answer (the call, and further calls where it allows them), so the
  request is complete when it is.

``Guide.advance`` returns True once the answer's grammar is complete (nothing but EOS could
follow): the sampler's caller finishes the request with reason "stop" there, without another
step. So does a forced answer's (``in_tool``). A complete tool call the model opened itself
does not end the request (the model may call another).
"""
from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import os
import re
import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidRequest

log = logging.getLogger(__name__)

#: whitespace tokens allowed between a reasoning block and the answer (models write "\n\n"
#: after </think>)
GAP_TOKENS = 4


@dataclass(frozen=True)
class GuideSpec:
    grammar: str | None                   # the answer's (llguidance's grammar, JSON text): json_schema(), regex(), lark()
    reasoning: bool = False               # output starts inside a reasoning block
    open_reasoning: int | None = None     # token opening a reasoning block where the answer starts
    close_reasoning: int | None = None    # token closing it
    escape: tuple[int, ...] = ()          # tokens opening a tool call (allowed where the answer starts)
    tool_grammar: str | None = None       # a tool call's, after its opening token (None: the call is free)
    in_tool: str | None = None            # the rest of a tool call the prompt already opened


def _one_line(message: str) -> str:
    """llguidance's message without the drawing of the grammar we generated around the user's
    schema or pattern (nor its positions in it), on one line."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line and not re.match(r"^(\d+ \||\^+$)", line)]
    return re.sub(r"^at \d+\(\d+\): ", "", " ".join(kept))


def _checked(grammar: str, what: str) -> str:
    import llguidance
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:   # the first line says what; the rest draws the grammar we generated around it
        raise InvalidRequest(f"{what}: {_one_line(error)}")
    return grammar


def json_schema(schema: dict | bool, what: str = "the JSON schema") -> str:
    """A grammar for JSON text matching ``schema`` (compact: no whitespace around or inside).
    Raises InvalidRequest naming what is wrong with the schema."""
    if schema is True:
        schema = {}
    if isinstance(schema, dict):   # compact JSON, as OpenAI writes it (and no runaway whitespace)
        schema = {**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}}
    try:
        body = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"{what} is not JSON: {exc}") from None
    return lark(f"start: %json {body}", what)


def regex(pattern: str, what: str = "the regex") -> str:
    import llguidance
    try:
        return _checked(llguidance.LLMatcher.grammar_from_regex(pattern), what)
    except InvalidRequest:
        raise
    except Exception as exc:   # noqa: BLE001  llguidance raises ValueError/RuntimeError variously
        raise InvalidRequest(f"{what}: {_one_line(str(exc))}") from None


def choice(options: list[str], what: str = "the choice") -> str:
    """Exactly one of ``options`` (literal strings)."""
    if not options or not all(isinstance(o, str) and o for o in options):
        raise InvalidRequest(f"{what} must be a non-empty list of non-empty strings")
    return lark("start: " + " | ".join(json.dumps(o) for o in options), what)


def lark(source: str, what: str = "the grammar") -> str:
    import llguidance
    try:
        return _checked(llguidance.LLMatcher.grammar_from_lark(source), what)
    except InvalidRequest:
        raise
    except Exception as exc:   # noqa: BLE001
        raise InvalidRequest(f"{what}: {_one_line(str(exc))}") from None


@dataclass(frozen=True)
class Tables:
    """What llguidance needs of a tokenizer, built once per process (``tables``)."""
    lltok: object              # llguidance.LLTokenizer, ready for masks
    whitespace: torch.Tensor   # ids of the tokens that are only whitespace (allowed after </think>)


def _build(tokenizer, n_vocab: int, eos: tuple[int, ...]) -> Tables:
    import llguidance
    from llguidance.torch import fill_next_token_bitmask
    tik = tokenizer.tiktoken
    if tik is not None:     # Moonshot's tiktoken tokenizer: its ranks, specials and split pattern
        lltok = llguidance.LLTokenizer.from_tiktoken(encoder=tik.ranks, special_tokens=tik.special,
                                                     pattern=tik.pattern, eos_token=list(eos), n_vocab=n_vocab)
    else:
        lltok = llguidance.LLTokenizer(tokenizer.json_text, n_vocab=n_vocab, eos_token=list(eos))
    # the first mask ever computed sets up llguidance's per-tokenizer tables: pay it here
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}))
    fill_next_token_bitmask(matcher, torch.zeros(1, (n_vocab + 31) // 32, dtype=torch.int32))
    whitespace = [t for t in range(n_vocab) if (b := lltok.decode_bytes([t])) and not b.strip(b" \t\r\n")]
    return Tables(lltok, torch.tensor(whitespace, dtype=torch.long))


_builds: dict[tuple, concurrent.futures.Future] = {}
_builds_lock = threading.Lock()


def tables(tokenizer, n_vocab: int) -> concurrent.futures.Future:
    """The build of ``tokenizer``'s ``Tables`` for ``n_vocab`` logits, started in a thread on the
    first call; every later call gets the same future. Built on first need, not at load: a model
    served without grammars never pays for them (0.9-1.6 s for a 49k vocabulary on a 2-CPU VM,
    4.3-4.8 s on the H200 machine's host); the scheduler keeps a constrained request waiting
    (the others run) and the server awaits them without blocking, until they are there."""
    key = (tokenizer.identity, n_vocab, tuple(tokenizer.eos_token_ids))
    with _builds_lock:
        future = _builds.get(key)
        if future is None:
            future = _builds[key] = concurrent.futures.Future()

            def build():
                try:
                    future.set_result(_build(tokenizer, n_vocab, key[2]))
                except Exception as exc:   # noqa: BLE001  delivered to whoever needs the tables
                    log.warning("constrained decoding is unavailable for this tokenizer: %s", exc)
                    future.set_exception(exc)
            threading.Thread(target=build, name="freetoken-grammar-tables", daemon=True).start()
        return future


def tables_ready(tokenizer, n_vocab: int) -> bool:
    """Whether the tables are built (the first call starts the build)."""
    return tables(tokenizer, n_vocab).done()


def ll_tokenizer(tokenizer, n_vocab: int):
    """llguidance's view of ``tokenizer`` (models/tokenizer.Tokenizer) for logits of ``n_vocab``
    entries, ready for masks; waited for here."""
    return tables(tokenizer, n_vocab).result().lltok


def _matcher(lltok, grammar: str):
    import llguidance
    m = llguidance.LLMatcher(lltok, grammar, log_level=0)   # errors are read and reported here
    if m.is_error():
        raise InvalidRequest(f"the grammar cannot be used: {m.get_error()}")
    return m


class Guide:
    """One request's constraint: ``constrain(logits)`` before a sample, ``advance(token)`` after.

    States: "answer" (the answer's grammar), "reasoning" (free until the closing token), "text"
    (free: no answer grammar, or the model called a tool instead), "tool" (inside a tool call,
    under ``tool_grammar``; back to "text" when the call is complete)."""

    def __init__(self, spec: GuideSpec, tokenizer, n_vocab: int):
        self.spec = spec
        try:
            self._tables = tables(tokenizer, n_vocab).result()
        except Exception as exc:   # noqa: BLE001  a tokenizer llguidance cannot read
            raise InvalidRequest(f"constrained decoding is unavailable for this model's tokenizer: {exc}") from None
        self._lltok = self._tables.lltok
        self.answer = _matcher(self._lltok, spec.grammar) if spec.grammar else None
        self.tool = _matcher(self._lltok, spec.in_tool) if spec.in_tool else None
        self.state = ("tool" if spec.in_tool else "reasoning" if spec.reasoning else
                      "answer" if spec.grammar else "text")
        self.n_vocab = n_vocab
        self.started = False              # the answer's grammar has consumed a token
        self.gap = 0                      # whitespace tokens still allowed before the answer
        extra = [t for t in (spec.open_reasoning, *spec.escape) if t is not None and 0 <= t < n_vocab]
        self._extra = torch.tensor(extra, dtype=torch.long)

    @property
    def active(self) -> bool:
        """The next token is constrained."""
        return self.state in ("answer", "tool")

    @property
    def matcher(self):
        """The grammar the next token is under (None when it is free)."""
        return self.answer if self.state == "answer" else self.tool if self.state == "tool" else None

    def extra_tokens(self) -> torch.Tensor:
        """Tokens allowed besides the grammar's: where the answer starts, a reasoning block's or a
        tool call's opening token, and after a reasoning block, whitespace."""
        if self.state != "answer" or self.started:
            return self._extra[:0]
        if self.gap:
            return torch.cat([self._extra, self._tables.whitespace])
        return self._extra

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [V]`` with what the grammar forbids at -inf (a new tensor; unchanged when the
        next token is free)."""
        if not self.active:
            return logits
        return apply_masks(logits[None], fill_masks([self]))[0]

    def advance(self, token: int) -> bool:
        """Record the sampled token; True when the answer's grammar is complete."""
        spec, state = self.spec, self.state
        if state == "reasoning":
            if token == spec.close_reasoning:
                self.state = "answer" if self.answer is not None and not self.started else "text"
                self.gap = GAP_TOKENS
            elif token in spec.escape and spec.tool_grammar:   # Qwen3.5 calls tools from its reasoning
                self.state, self.tool = "tool", _matcher(self._lltok, spec.tool_grammar)
            return False
        if state == "tool":
            self._consume(self.tool, token)
            if self.tool.is_stopped():
                if spec.in_tool is not None:
                    return True     # a forced answer is its calls: complete, nothing may follow
                self.state, self.tool = "text", None
            return False
        opening = state == "text" or not self.started
        if opening and token == spec.open_reasoning:
            self.state = "reasoning"
        elif opening and token in spec.escape:
            self.state = "text"
            if spec.tool_grammar:
                self.state, self.tool = "tool", _matcher(self._lltok, spec.tool_grammar)
        elif state == "answer":
            if self.gap and not self.answer.validate_tokens([token]):   # whitespace before the answer
                self.gap -= 1
                return False
            self.gap = 0
            self._consume(self.answer, token)
            self.started = True
            return self.answer.is_stopped()
        return False

    @staticmethod
    def _consume(matcher, token: int) -> None:
        if not matcher.consume_token(token):
            # only a bug (the mask allowed it) gets here; the output so far still stands
            raise InvalidRequest(f"token {token} broke the grammar: {matcher.get_error()}")


@functools.lru_cache(maxsize=1)
def _executor():
    import llguidance
    return llguidance.LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))


def fill_masks(guides: list[Guide]) -> torch.Tensor:
    """The tokens each (active) guide allows, as bitmask rows ``[n, W]`` int32 on the CPU (bit
    ``t % 32`` of word ``t // 32``: token t), the grammars' part computed in parallel by
    llguidance's threads when there are several."""
    from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par
    bits = torch.zeros(len(guides), (guides[0].n_vocab + 31) // 32, dtype=torch.int32)
    if len(guides) == 1:
        fill_next_token_bitmask(guides[0].matcher, bits)
    else:
        fill_next_token_bitmask_par(_executor(), [(g.matcher, i) for i, g in enumerate(guides)], bits)
    words = bits.numpy().view(np.uint32)
    for row, g in zip(words, guides):
        for t in g.extra_tokens().tolist():
            row[t >> 5] |= np.uint32(1 << (t & 31))
    return bits


def apply_masks(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``logits [n, V]`` as float32 with the tokens ``bits [n, W]`` forbid at -inf: a new
    tensor on the logits' device, one masked fill for the batch (llguidance's own helper is a
    torch.compile kernel: seconds of compiling on a first request)."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = bits.to(logits.device, non_blocking=True)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : logits.shape[-1]]   # [n, V]
    return logits.float().masked_fill(allowed == 0, float("-inf"))


def constrained_rows(logits: torch.Tensor, guides: dict[int, Guide]) -> dict[int, torch.Tensor]:
    """Row -> ``logits[row]`` under its guide's mask, for the rows in ``guides`` (the scheduler's
    batch: the masks computed together, applied in one op)."""
    if not guides:
        return {}
    rows = list(guides)
    out = apply_masks(logits[rows], fill_masks(list(guides.values())))
    return {row: out[i] for i, row in enumerate(rows)}


__all__ = ["Guide", "GuideSpec", "apply_masks", "choice", "constrained_rows", "fill_masks", "json_schema", "lark",
           "ll_tokenizer", "regex", "tables", "tables_ready"]
