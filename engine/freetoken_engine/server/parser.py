"""Split a model's raw output into reasoning, content and tool calls, incrementally.

The model writes one text stream in its own format, Qwen3 / Hermes (``style="json"``):

    <think>reasoning...</think>\n\ncontent <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>

or Qwen3.5/3.6 and Qwen3-Coder's (``style="xml"``), each parameter's value as raw text:

    <tool_call>\n<function=f>\n<parameter=path>\nsrc/app.py\n</parameter>\n</function>\n</tool_call>

An XML call's arguments become a JSON object, each value typed by the tool's JSON Schema
(``schemas``: tool name -> its ``parameters``): integers, numbers, booleans, null, objects and
arrays are parsed from their text when it is valid, strings and unknown parameters stay text.
Its arguments stream a parameter at a time. Qwen3.5 may open a tool call inside its reasoning
without closing ``</think>``: with the XML style and tools, ``<tool_call>`` ends the reasoning,
and a ``</think>`` the model writes later is dropped, not shown as content.

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
FUNCTION_OPEN = "<function="          # the XML style's head: <function=NAME>
_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
_XML_TAGS = ("<parameter=", "</function>", TOOL_CLOSE)

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

    def __init__(self, *, tools: bool, in_reasoning: bool = False, style: str = "json",
                 schemas: dict[str, dict] | None = None):
        if style not in ("json", "xml"):
            raise ValueError(f"tool-call style {style!r}: 'json' or 'xml'")
        self.tools, self.xml, self.schemas = tools, style == "xml", schemas or {}
        self.mode = "reasoning" if in_reasoning else "content"
        self.buf = ""
        self.n_tools = 0
        self._strip_ws = False        # drop the blank line(s) a model writes after </think>
        self._think_unclosed = False  # a tool call ended the reasoning: a later </think> is dropped
        self._body = ""               # current tool-call body
        self._started = False         # current tool call's ToolStart emitted
        self._args_end: _JsonValueEnd | None = None
        self._args_done = False
        self._name = ""               # XML: the current call's tool name
        self._params = 0              # XML: parameters emitted for the current call

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self.buf:
            before = (self.mode, len(self.buf), self._started)
            if self.mode == "content":
                self._step_content(out)
            elif self.mode == "reasoning":
                self._step_reasoning(out)
            elif self.xml:
                self._step_xml_tool(out)
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
        elif self.mode == "tool" and self.xml:
            self._body += rest
            self._xml_close(out, complete=False)
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
        if self._think_unclosed:
            tags += (THINK_CLOSE,)
        hits = [(self.buf.find(t), t) for t in tags]
        hits = [(at, t) for at, t in hits if at != -1]
        if hits:
            at, tag = min(hits)
            if at:
                self._emit_content(self.buf[:at], out)
            self.buf = self.buf[at + len(tag):]
            if tag == THINK_OPEN:
                self.mode, self._think_unclosed = "reasoning", False
            elif tag == THINK_CLOSE:              # the reasoning's late close: dropped
                self._strip_ws, self._think_unclosed = True, False
            else:
                self._open_tool()
            return
        keep = _partial_tag(self.buf, tags)
        if len(self.buf) > keep:
            self._emit_content(self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]

    def _open_tool(self) -> None:
        self.mode, self._body, self._started = "tool", "", False
        self._args_end, self._args_done, self._name, self._params = None, False, "", 0

    def _step_reasoning(self, out: list[Event]) -> None:
        tags = (THINK_CLOSE, TOOL_OPEN) if self.xml and self.tools else (THINK_CLOSE,)
        hits = [(at, t) for at, t in ((self.buf.find(t), t) for t in tags) if at != -1]
        if hits:
            at, tag = min(hits)
            if at:
                out.append(Reasoning(self.buf[:at]))
            self.buf = self.buf[at + len(tag):]
            if tag == TOOL_OPEN:                   # Qwen3.5: a call opened inside the reasoning ends it
                self._open_tool()
                self._think_unclosed = True
            else:
                self.mode, self._strip_ws = "content", True
            return
        keep = _partial_tag(self.buf, tags)
        if len(self.buf) > keep:
            out.append(Reasoning(self.buf[: len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]

    def _step_tool(self, out: list[Event]) -> None:
        if self._started and not self._args_done:
            # inside the arguments value: its JSON decides where it ends, so a "</tool_call>"
            # inside a JSON string is argument text, not the closing tag
            if not self._args_end.started:     # whitespace before the value is not argument text
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return
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

    # -- XML tool calls --------------------------------------------------------------------
    def _step_xml_tool(self, out: list[Event]) -> None:
        """Everything after <tool_call> is the body until its structure closes: the head
        <function=NAME>, then whole <parameter=KEY>...</parameter> blocks (a parameter's text
        may hold any tag but its own closing one), then </function> and </tool_call>."""
        self._body, self.buf = self._body + self.buf, ""
        body = self._body
        if not self._started:
            head = _XML_FUNCTION.match(body)
            if head is None:
                close = body.find(TOOL_CLOSE)
                if close != -1:                   # no function head: a JSON body, else the model's text
                    self.buf, self._body = body[close + len(TOOL_CLOSE):], body[:close]
                    self._close_tool(out, complete=True)
                    self.mode, self._strip_ws = "content", True
                return
            self._name, self._started, self._pos = head.group(1).strip(), True, head.end()
            out.append(ToolStart(self.n_tools, self._name))
        while True:
            rest = body[self._pos:]
            gap = len(rest) - len(rest.lstrip())
            rest = rest[gap:]
            if rest.startswith("<parameter="):
                param = _XML_PARAMETER.match(rest)
                close = rest.find("</parameter>") if param else -1
                if close == -1:
                    return                        # the value is still arriving
                self._xml_param(out, param.group(1).strip(), rest[param.end():close])
                self._pos += gap + close + len("</parameter>")
            elif rest.startswith("</function>"):
                self._pos += gap + len("</function>")
            elif rest.startswith(TOOL_CLOSE):
                self.buf = rest[len(TOOL_CLOSE):]
                self._xml_close(out, complete=True)
                self.mode, self._strip_ws = "content", True
                return
            else:
                nxt = [at for at in (rest.find(t) for t in _XML_TAGS) if at > 0]
                if not nxt:
                    return                        # a tag may still be arriving
                self._pos += gap + min(nxt)       # text between the tags: skipped

    def _xml_param(self, out: list[Event], key: str, raw: str) -> None:
        if raw.startswith("\n"):
            raw = raw[1:]
        if raw.endswith("\n"):
            raw = raw[:-1]
        schema = (self.schemas.get(self._name) or {}).get("properties", {}).get(key)
        value = json.dumps(_typed(raw, schema), ensure_ascii=False)
        out.append(ToolArgs(self.n_tools, ("{" if self._params == 0 else ", ") + json.dumps(key) + ": " + value))
        self._params += 1

    def _xml_close(self, out: list[Event], *, complete: bool) -> None:
        """The call's arguments object closed and ToolEnd; an unfinished parameter at the end of
        generation is kept as its text so far. Without a function head: as a JSON body."""
        if not self._started:
            self._close_tool(out, complete=complete)
        else:
            if not complete:
                rest = self._body[self._pos:].lstrip()
                param = _XML_PARAMETER.match(rest)
                if param is not None:
                    self._xml_param(out, param.group(1).strip(), rest[param.end():])
            out.append(ToolArgs(self.n_tools, "}" if self._params else "{}"))
            out.append(ToolEnd(self.n_tools))
            self.n_tools += 1
        self._body, self._started, self._name, self._params = "", False, "", 0

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


def _typed(raw: str, schema) -> object:
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
