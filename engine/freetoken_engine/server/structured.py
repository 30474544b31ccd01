"""Structured outputs, logit biases and log-probabilities: the request fields of every protocol
turned into the engine's terms, and the engine's log-probabilities into the protocols' shapes.

Formats (each compiles to an llguidance grammar, ``executor/guide.py``; a schema or pattern it
cannot use is a 400 that names the field and says why):

- OpenAI chat/completions ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``.
- Responses ``text.format``: the same types, the schema's fields flattened into it.
- Anthropic ``output_config.format`` (and the beta ``output_format``):
  ``{"type": "json_schema", "schema"}``.
- vLLM's ``structured_outputs`` (chat and completions): one of ``json`` (a schema), ``regex``,
  ``choice`` (a list of strings), ``grammar`` (lark).

The constraint applies to the answer: a reasoning block before it is free, and with tools on
``auto`` the model may call a tool instead (the call's arguments are then its own).
"""
from __future__ import annotations

import asyncio
from typing import Any

from ..errors import InvalidRequest
from ..executor import guide
from ..executor.guide import GuideSpec
from .errors import ApiError
from .parser import opening_tag, think_tags
from .tool_grammar import tool_grammars
from .tool_grammar_harmony import harmony_escapes

_FORMATS = "'text', 'json_object' or 'json_schema'"


def _compiled(make, param: str, *args) -> str:
    try:
        return make(*args)
    except InvalidRequest as exc:
        raise ApiError(400, f"{param}: {exc}", param=param) from None


def _schema(value: Any, param: str) -> dict | bool:
    if value is None:
        return {}
    if not isinstance(value, (dict, bool)):
        raise ApiError(400, f"{param}: a JSON Schema is an object, got {type(value).__name__}",
                       param=param)
    return value


def format_grammar(fmt: Any, param: str, *, nested: bool) -> str | None:
    """The grammar of a response format; None for plain text. ``nested``: OpenAI chat's shape
    (the schema under ``json_schema``); else the flattened one of Responses and Anthropic."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError(400, f"{param} must be an object with a 'type' of {_FORMATS}", param=param)
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _compiled(guide.json_schema, param, {"type": "object"})
    if kind != "json_schema":
        raise ApiError(400, f"{param}.type must be {_FORMATS}, got {kind!r}", param=f"{param}.type")
    where, body = (f"{param}.json_schema", fmt.get("json_schema")) if nested else (param, fmt)
    if not isinstance(body, dict):
        raise ApiError(400, f"{where} must be an object with the 'schema'", param=where)
    schema = _schema(body.get("schema"), f"{where}.schema")
    return _compiled(guide.json_schema, f"{where}.schema", schema)


def structured_grammar(spec: dict | None, param: str = "structured_outputs") -> str | None:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar."""
    if not spec:
        return None
    given = {k: v for k, v in spec.items() if k in ("json", "regex", "choice", "grammar") and v is not None}
    if len(given) != 1:
        raise ApiError(400, f"{param} takes exactly one of 'json', 'regex', 'choice', 'grammar'",
                       param=param)
    (kind, value), = given.items()
    where = f"{param}.{kind}"
    if kind == "json":
        return _compiled(guide.json_schema, where, _schema(value, where))
    if kind == "choice":
        if not isinstance(value, list):
            raise ApiError(400, f"{where} must be a list of strings", param=where)
        return _compiled(guide.choice, where, value)
    if not isinstance(value, str):
        raise ApiError(400, f"{where} must be a string", param=where)
    return _compiled(guide.regex if kind == "regex" else guide.lark, where, value)


def guide_spec(grammar: str | None, tokenizer, prompt) -> GuideSpec | None:
    """The engine's constraint for a rendered ``prompt`` (server/prompt.Prompt): the answer's
    ``grammar`` (not when the prompt already opens a tool call), and the tool calls' grammar
    where they must follow their schemas (``tool_grammars``); None when nothing is constrained."""
    open_, close = (tokenizer.token_to_id(tag) for tag in think_tags(prompt.style))
    calls, rest = tool_grammars(tokenizer, prompt) if prompt.tools else (None, None)
    if prompt.prefill:
        grammar = None
    if prompt.style == "harmony":
        # <|channel|> (and <|start|>) open every message, not only calls: with strict tools the
        # grammar after them holds whole messages, and there is no escape from an answer's grammar
        escape = harmony_escapes(tokenizer) if calls is not None and grammar is None else ()
    else:
        tool = tokenizer.token_to_id(opening_tag(prompt.style)) if prompt.tools else None
        escape = () if tool is None else (tool,)
    if not escape:
        # no <tool_call> token (SmolLM2): a call the model opens is text the guide cannot see
        # start, but a call the pre-fill opened (tool_choice) is still held to its schema
        calls = None
    if grammar is None and calls is None and rest is None:
        return None
    reasoning = prompt.in_reasoning and close is not None
    if close is not None and close in prompt.ids[-4:]:
        open_ = None     # the template wrote an empty reasoning block: thinking is switched off
    return GuideSpec(grammar, reasoning=reasoning, open_reasoning=open_, close_reasoning=close,
                     escape=escape, tool_grammar=calls, in_tool=rest)


def logit_bias(raw: dict | None, param: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` (ids as strings) -> ((id, bias), ...)."""
    out = []
    for key, bias in (raw or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"{param}: keys are token ids, got {key!r}", param=param) from None
        if token < 0 or not -100 <= bias <= 100:
            raise ApiError(400, f"{param}: token {key}: ids are >= 0 and biases within -100..100, "
                                f"got {bias}", param=param)
        out.append((token, float(bias)))
    return tuple(out)


class LogprobText:
    """Token ids -> their text and bytes, for the log-probability entries. The bytes come from
    the grammar engine's tokenizer tables: created here, their build starts (once per process),
    and ``ready()`` awaits it without blocking the event loop."""

    def __init__(self, tokenizer, n_vocab: int):
        self._tables = guide.tables(tokenizer, n_vocab)

    async def ready(self) -> None:
        await asyncio.wrap_future(self._tables)

    def piece(self, token: int) -> tuple[str, list[int]]:
        raw = self._tables.result().lltok.decode_bytes([token])
        raw = raw[1:] if raw[:1] == b"\xff" else raw     # llguidance marks special tokens with 0xFF
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat(self, token: int, logprob: tuple) -> dict:
        """One entry of OpenAI chat's ``logprobs.content``."""
        lp, alts = logprob
        text, raw = self.piece(token)
        top = []
        for alt, alt_lp in alts:
            t, b = self.piece(alt)
            top.append({"token": t, "logprob": alt_lp, "bytes": b})
        return {"token": text, "logprob": lp, "bytes": raw, "top_logprobs": top}


def completion_logprobs(entries: list[dict]) -> dict:
    """Chat-shaped entries -> the legacy completions ``logprobs`` object."""
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}
