"""A JSON list of tool calls, streamed: Granite's answer after its ``<|tool_call|>`` token,

    [{"name": "f", "arguments": {...}}, {"name": "g", "arguments": {...}}]

or Cohere's after ``<|START_ACTION|>`` (``COHERE_HEAD``), each call with an id first:

    [{"tool_call_id": "0", "tool_name": "f", "parameters": {...}}]

``CallList.feed(text)`` takes the text after the list's opening tag piece by piece and returns
``(events, rest)``: the calls' events (``ToolStart`` / ``ToolArgs`` / ``ToolEnd``, numbered
from ``first``) and, once the list has closed, the text after it (else ""). A call
whose object starts ``{"name": ..., "arguments": `` streams its arguments as they arrive; one
in another key order is parsed whole when its object closes. Text that is not such a list is
``failed``: what was read of it since the last whole call is in ``unread``, for the caller to
show as the model's text, so nothing the model wrote is lost.
"""
from __future__ import annotations

import re

from .parser_text import CALL_HEAD, JsonValueEnd, ToolArgs, ToolEnd, ToolStart, parse_whole, unquote

# Cohere's call object as it begins, up to where its parameters start
COHERE_HEAD = re.compile(r'\s*\{\s*"tool_call_id"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"tool_name"\s*:\s*'
                         r'"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*')


class CallList:
    def __init__(self, first: int, head: re.Pattern = CALL_HEAD):
        self.head = head             # a call object's start, up to its arguments (the name its group)
        self.index = first           # the next call's index
        self.state = "open"          # open | element | args | tail | after | done | failed
        self.unread = ""             # the current element's text, kept until it is decided
        self._end: JsonValueEnd | None = None    # the arguments value's end, then the element's
        self._scan: JsonValueEnd | None = None    # an element in another key order: its end

    def feed(self, text: str) -> tuple[list, str]:
        out: list = []
        while text and self.state not in ("done", "failed"):
            text = getattr(self, "_" + self.state)(text, out)
        return out, text if self.state == "done" else ""

    def finish(self) -> list:
        """The end of generation: an open call is ended (its arguments as far as they came), a
        whole element not yet parsed is parsed; anything else stays ``unread``."""
        out: list = []
        if self.state in ("args", "tail"):
            self._end_call(out)
        elif self.state == "element" and (call := parse_whole(self.unread)) is not None:
            self._whole(call, out)
        return out

    # -- states: each takes the text, returns what is left of it ------------------------------
    def _open(self, text: str, out: list) -> str:
        body = text.lstrip()
        if not body:
            return ""
        if body[0] != "[":
            return self._fail(text)
        self.state = "element"
        return body[1:]

    def _after(self, text: str, out: list) -> str:
        """Between elements: a comma, or the list's close."""
        body = text.lstrip()
        if not body:
            return ""
        if body[0] == ",":
            self.state = "element"
            return body[1:]
        if body[0] == "]":
            self.state = "done"
            return body[1:]
        return self._fail(text)

    def _element(self, text: str, out: list) -> str:
        if not self.unread and not text.strip():
            return ""
        if not self.unread and text.lstrip().startswith("]"):
            self.state = "done"                 # an empty list, or a comma before the close
            return text.lstrip()[1:]
        start = len(self.unread)
        if not start:                           # where this element's object ends, found as it comes
            self._scan = JsonValueEnd()
        self.unread += text
        head = self.head.match(self.unread)
        if head is not None:
            rest = self.unread[head.end():]
            self.unread = ""
            out.append(ToolStart(self.index, unquote(head.group(1))))
            self.state, self._end = "args", JsonValueEnd()
            return rest
        if not self.unread.lstrip().startswith("{"):
            return self._fail("")
        n = start + self._scan.feed(text)
        if self._scan.done:                     # a whole object in another key order
            element, rest = self.unread[:n], self.unread[n:]
            call = parse_whole(element)
            if call is None:
                return self._fail("")
            self.unread = ""
            self._whole(call, out)
            self.state = "after"
            return rest
        return ""

    def _args(self, text: str, out: list) -> str:
        if not self._end.started:               # whitespace before the value is not argument text
            text = text.lstrip()
            if not text:
                return ""
        n = self._end.feed(text)
        if n:
            out.append(ToolArgs(self.index, text[:n]))
        if self._end.done:
            self.state, self._end = "tail", JsonValueEnd()
            self._end.depth = 1                 # inside the element's object: up to its "}"
        return text[n:]

    def _tail(self, text: str, out: list) -> str:
        """After the arguments: the element's close (any other keys are passed over)."""
        n = self._end.feed(text)
        if self._end.done:
            self._end_call(out)
            self.state = "after"
        return text[n:]

    # -- helpers -------------------------------------------------------------------------------
    def _fail(self, text: str) -> str:
        self.unread += text
        self.state = "failed"
        return ""

    def _end_call(self, out: list) -> None:
        out.append(ToolEnd(self.index))
        self.index += 1

    def _whole(self, call: tuple[str, str], out: list) -> None:
        name, args = call
        out += [ToolStart(self.index, name), ToolArgs(self.index, args)]
        self._end_call(out)
