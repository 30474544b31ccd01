"""Split a model's raw output into reasoning, content and tool calls, incrementally.

The model writes one text stream in its own format (Qwen3 / Hermes):

    <think>reasoning...</think>\n\ncontent <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>

``OutputParser.feed(text)`` turns each new piece of that stream into protocol-neutral events,
which the OpenAI and Anthropic modules render as deltas / content blocks:

- ``Reasoning(text)``, ``Content(text)``;
- ``ToolStart(index, name)`` as soon as the tool's name is known, then ``ToolArgs(index, text)``
  fragments of the JSON ``arguments`` object as they arrive, then ``ToolEnd(index)``.

A tag split across pieces is held back until it is decided, so no piece of a tag is ever shown.
Arguments are streamed raw from the model's JSON; a tool call whose body is not the expected
object shape is parsed whole at ``</tool_call>``; one that does not parse at all is returned as
ordinary content (so nothing the model wrote is lost). Not thread-safe; one per request.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

# The Hermes/Qwen body as it begins: {"name": "<name>", "arguments": <value...>
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


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


Event = Reasoning | Content | ToolStart | ToolArgs | ToolEnd


def _partial_tag(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``tags``."""
    for n in range(min(len(buf), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(buf[-n:]) for t in tags):
            return n
    return 0


class _JsonValueEnd:
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


class OutputParser:
    """Incremental reasoning / content / tool-call splitter (see the module docstring).

    ``in_reasoning``: the prompt already opened ``<think>`` (templates that force thinking), so
    output starts as reasoning. ``tools``: parse ``<tool_call>`` blocks; without tools the tags
    are ordinary content.
    """

    def __init__(self, *, tools: bool, in_reasoning: bool = False):
        self.tools = tools
        self.mode = "reasoning" if in_reasoning else "content"
        self.buf = ""
        self.n_tools = 0
        self._strip_ws = False        # drop the blank line(s) a model writes after </think>
        self._body = ""               # current tool-call body
        self._started = False         # current tool call's ToolStart emitted
        self._args_end: _JsonValueEnd | None = None
        self._args_done = False

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self.buf:
            before = (self.mode, len(self.buf), self._started)
            if self.mode == "content":
                self._step_content(out)
            elif self.mode == "reasoning":
                self._step_reasoning(out)
            else:
                self._step_tool(out)
            if (self.mode, len(self.buf), self._started) == before:
                break          # waiting for more text to decide a partial tag
        return out

    def finish(self) -> list[Event]:
        """Flush at the end of generation: held text is emitted, an open tool call is closed."""
        out: list[Event] = []
        rest, self.buf = self.buf, ""
        if self.mode == "reasoning":
            if rest:
                out.append(Reasoning(rest))
        elif self.mode == "tool":
            self._body += rest
            self._close_tool(out, complete=False)
        elif rest:
            self._emit_content(rest, out)
        return out

    # -- modes -----------------------------------------------------------------------------
    def _emit_content(self, text: str, out: list[Event]) -> None:
        if self._strip_ws:
            text = text.lstrip()
            if not text:
                return
            self._strip_ws = False
        out.append(Content(text))

    def _step_content(self, out: list[Event]) -> None:
        tags = (THINK_OPEN, TOOL_OPEN) if self.tools else (THINK_OPEN,)
        hits = [(self.buf.find(t), t) for t in tags]
        hits = [(at, t) for at, t in hits if at != -1]
        if hits:
            at, tag = min(hits)
            if at:
                self._emit_content(self.buf[:at], out)
            self.buf = self.buf[at + len(tag):]
            if tag == THINK_OPEN:
                self.mode = "reasoning"
            else:
                self.mode, self._body, self._started = "tool", "", False
                self._args_end, self._args_done = None, False
            return
        keep = _partial_tag(self.buf, tags)
        if len(self.buf) > keep:
            self._emit_content(self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]

    def _step_reasoning(self, out: list[Event]) -> None:
        at = self.buf.find(THINK_CLOSE)
        if at != -1:
            if at:
                out.append(Reasoning(self.buf[:at]))
            self.buf = self.buf[at + len(THINK_CLOSE):]
            self.mode, self._strip_ws = "content", True
            return
        keep = _partial_tag(self.buf, (THINK_CLOSE,))
        if len(self.buf) > keep:
            out.append(Reasoning(self.buf[: len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]

    def _step_tool(self, out: list[Event]) -> None:
        if self._started and not self._args_done:
            # inside the arguments value: its JSON decides where it ends, so a "</tool_call>"
            # inside a JSON string is argument text, not the closing tag
            n = self._args_end.feed(self.buf)
            if n:
                out.append(ToolArgs(self.n_tools, self.buf[:n]))
                self._body += self.buf[:n]
            self.buf, self._args_done = self.buf[n:], self._args_end.done
            return
        at = self.buf.find(TOOL_CLOSE)
        upto = at if at != -1 else len(self.buf) - _partial_tag(self.buf, (TOOL_CLOSE,))
        if not self._started:
            head = _HEAD.match(self._body + self.buf[:upto])
            if head is not None:
                used = head.end() - len(self._body)
                self._body += self.buf[:used]
                self.buf = self.buf[used:]
                self._started, self._args_end = True, _JsonValueEnd()
                out.append(ToolStart(self.n_tools, _unquote(head.group(1))))
                return
        self._body += self.buf[:upto]
        if at != -1:
            self.buf = self.buf[at + len(TOOL_CLOSE):]
            self._close_tool(out, complete=True)
            self.mode, self._strip_ws = "content", True
        else:
            self.buf = self.buf[upto:]

    # -- tool calls ------------------------------------------------------------------------
    def _close_tool(self, out: list[Event], *, complete: bool) -> None:
        if self._started:
            out.append(ToolEnd(self.n_tools))
            self.n_tools += 1
        else:
            call = _parse_whole(self._body)
            if call is None:
                raw = TOOL_OPEN + self._body + (TOOL_CLOSE if complete else "")
                self._emit_content(raw, out)
            else:
                name, args = call
                out += [ToolStart(self.n_tools, name), ToolArgs(self.n_tools, args),
                        ToolEnd(self.n_tools)]
                self.n_tools += 1
        self._body, self._started, self._args_end, self._args_done = "", False, None, False


def _unquote(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


def _parse_whole(body: str) -> tuple[str, str] | None:
    """A complete tool-call body in any key order -> (name, arguments JSON text), else None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)
