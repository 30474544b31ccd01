"""gpt-oss's answers in OpenAI's harmony format (``style="harmony"``): a sequence of messages, each
a header and a body,

    <|channel|>analysis<|message|>reasoning...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"path": "a"}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

The prompt ends with ``<|start|>assistant``, so the first header starts at ``<|channel|>``. A
header names the message's channel and, for a tool call, its recipient (``to=functions.f``, in
the channel part or after the role: ``<|start|>assistant to=functions.f<|channel|>commentary
json``). Bodies of the ``analysis`` channel are reasoning; a body with a recipient is a call's
arguments (``functions.f`` calls ``f``; another recipient, a built-in tool such as ``browser.search``,
is named as written), streamed as they come; any other body (``final``, a ``commentary`` preamble)
is content. ``<|end|>`` ends a message, ``<|call|>`` and ``<|return|>`` (the model's stop tokens)
the turn. Headers are format, never shown; text outside any message (a model that writes no
header) is content. Without tools a call's body is shown as content, as the model wrote it.
"""
from __future__ import annotations

import re

from .parser_text import Content, Reasoning, ToolArgs, ToolEnd, ToolStart, partial_tag

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
#: every tag of the format: the stream decoder keeps them (they are special tokens)
TAGS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
_BODY_ENDS = (END, CALL, RETURN)
_HEADS = (START, CHANNEL)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


class HarmonyParser:
    """Incremental harmony splitter with ``OutputParser``'s interface (``feed``, ``finish``)."""

    def __init__(self, *, tools: bool):
        self.tools = tools
        self.buf = ""
        self.mode = "header"          # header | reasoning | content | tool | text (outside a message)
        self.n_tools = 0
        self._args = False            # the current call's arguments have begun

    def feed(self, text: str) -> list:
        self.buf += text
        out: list = []
        while self.buf:
            before = (self.mode, len(self.buf))
            if self.mode == "header":
                self._header(out)
            else:
                self._body(out)
            if (self.mode, len(self.buf)) == before:
                break                 # waiting for more text to decide a partial tag
        return out

    def finish(self) -> list:
        """Flush at the end of generation: a body's held text is emitted, an open call closed; an
        unfinished header (format, not the model's words) is dropped."""
        out: list = []
        if self.mode != "header":
            self._emit(out, self.buf)
            self._close(out)
        self.buf = ""
        return out

    def _header(self, out: list) -> None:
        head = self.buf.lstrip()
        if not head:
            return
        if not any(head.startswith(t) or t.startswith(head) for t in _HEADS):
            self.buf, self.mode = head, "text"        # words outside any message: content
            return
        at = head.find(MESSAGE)
        if at < 0:
            return
        header, self.buf = head[:at], head[at + len(MESSAGE):]
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient and self.tools:
            name = recipient.group(1)
            self.mode = "tool"
            self._args = False
            out.append(ToolStart(self.n_tools, name[len("functions."):] if name.startswith("functions.") else name))
        else:
            self.mode = "reasoning" if channel and channel.group(1) == "analysis" else "content"

    def _body(self, out: list) -> None:
        ends = _BODY_ENDS + (_HEADS if self.mode == "text" else ())
        at = min((i for i in (self.buf.find(t) for t in ends) if i >= 0), default=-1)
        if at < 0:
            keep = partial_tag(self.buf, ends)
            self._emit(out, self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return
        self._emit(out, self.buf[:at])
        rest = self.buf[at:]
        tag = next(t for t in ends if rest.startswith(t))
        self._close(out)
        self.buf = rest if tag in _HEADS else rest[len(tag):]
        self.mode = "header"

    def _emit(self, out: list, text: str) -> None:
        if not text:
            return
        if self.mode == "tool":
            self._args = True
            out.append(ToolArgs(self.n_tools, text))
        else:
            out.append(Reasoning(text) if self.mode == "reasoning" else Content(text))

    def _close(self, out: list) -> None:
        if self.mode == "tool":
            if not self._args:                    # a call without arguments: an empty object
                out.append(ToolArgs(self.n_tools, "{}"))
            out.append(ToolEnd(self.n_tools))
            self.n_tools += 1
