"""The pieces every tool-call grammar is made of (``tool_grammar``, ``tool_grammar_harmony``): JSON
values in a template's spacing, string literals, fresh rule names, and the pair of grammars a
format returns (a call the model opens, the rest of a forced one), compiled by llguidance with a
400 that names the tools when a strict schema cannot be used."""
from __future__ import annotations

import json

from ..errors import InvalidRequest
from ..executor import guide
from .errors import ApiError

COMPACT = {"whitespace_flexible": False}
SPACED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def lit(text: str) -> str:
    return json.dumps(text)     # a lark string literal


def json_arg(schema: dict | None, style: dict, default_type: str | None = None) -> str:
    body = dict(schema or {})
    if default_type:
        body.setdefault("type", default_type)
    return f"%json {json.dumps({**body, 'x-guidance': style})}"


class Rules:
    """Lark rules under fresh names."""

    def __init__(self):
        self.lines: list[str] = []

    def add(self, body: str, attrs: str = "") -> str:
        name = f"r{len(self.lines)}"
        self.lines.append(f"{name}{attrs}: {body}")
        return name


def held(rules: Rules, prompt, opened: str | None, named, required: str) -> tuple[str | None, str | None]:
    """The two grammars over ``rules``: from after the opening tag (``opened``; None: calls the
    model opens are not held), and the rest of the answer after a forced call's pre-fill:
    ``named(tool)`` for a named one, ``required`` for a required one."""
    def grammar(start: str) -> str:
        return "\n".join([f"start: {start}", *rules.lines])

    schemas = prompt.schemas or {}
    rest = grammar(named(prompt.forced)) if prompt.forced in schemas else grammar(required) if prompt.forced else None
    return both(None if opened is None else grammar(opened), rest, prompt)


def both(after_open: str | None, rest: str | None, prompt) -> tuple[str | None, str | None]:
    try:
        return (None if after_open is None else compiled(after_open), None if rest is None else compiled(rest))
    except ApiError:
        if prompt.strict:
            raise       # strictness was asked for: say why it cannot be had
        return None, None   # a forced call to a schema the grammar engine cannot use: pre-fill only


def compiled(source: str) -> str:
    try:
        return guide.lark(source, "tools")
    except InvalidRequest as exc:
        raise ApiError(400, f"tools: {exc}", param="tools") from None


__all__ = ["COMPACT", "SPACED", "Rules", "both", "compiled", "held", "json_arg", "lit"]
