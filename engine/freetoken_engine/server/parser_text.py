"""Text helpers of the output parser (``parser.py``): its events, held-back partial tags, where a
streamed JSON value ends, a whole Hermes call body, and an XML-style parameter's text typed by its
schema."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

# a JSON call object as it begins (Hermes/Qwen's body, an element of Granite's list), up to where
# its arguments value starts: {"name": "<name>", "arguments": <value...>
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class ToolStart:
    index: int
    name: str


@dataclass(frozen=True)
class ToolArgs:
    index: int
    text: str


@dataclass(frozen=True)
class ToolEnd:
    index: int


def partial_tag(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``tags``."""
    for n in range(min(len(buf), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(buf[-n:]) for t in tags):
            return n
    return 0


class JsonValueEnd:
    """Finds where one JSON value ends in text fed piece by piece (string-aware bracket depth)."""

    def __init__(self) -> None:
        self.depth, self.in_str, self.esc, self.started, self.done = 0, False, False, False, False

    def feed(self, text: str) -> int:
        """Consume ``text``; return how many of its characters belong to the value."""
        for i, ch in enumerate(text):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
            elif ch == '"':
                self.in_str, self.started = True, True
            elif ch in "{[":
                self.depth, self.started = self.depth + 1, True
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    return i + 1
            elif not ch.isspace():
                self.started = True
        return len(text)


def unquote(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


def parse_whole(body: str) -> tuple[str, str] | None:
    """A complete tool-call body in any key order -> (name, arguments JSON text), else None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    name = obj.get("name", obj.get("tool_name")) if isinstance(obj, dict) else None    # Cohere's: tool_name
    if not isinstance(name, str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return name, args
    return name, json.dumps(args, ensure_ascii=False)


def typed(raw: str, schema) -> object:
    """An XML parameter's text as the JSON value its schema's type asks for, else the text."""
    kinds = (schema or {}).get("type") if isinstance(schema, dict) else None
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if not any(k in ("integer", "number", "boolean", "null", "object", "array") for k in kinds):
        return raw
    text = raw.strip()
    try:
        value = json.loads(text)
    except ValueError:
        low = text.lower()
        if "boolean" in kinds and low in ("true", "false"):
            return low == "true"
        if "null" in kinds and low in ("none", "null"):
            return None
        return raw
    ok = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
          "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
          "string": lambda v: False}
    if any(ok.get(k, lambda v: False)(value) for k in kinds):
        return value
    if "integer" in kinds and isinstance(value, float) and value.is_integer():
        return int(value)
    return raw
