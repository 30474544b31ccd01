"""The tagged tool-call formats of the output parser (``parser.py``): XML (Qwen3.5/3.6,
Qwen3-Coder), GLM and MiniMax-M2, each a head naming the tool, then parameters between tags.
``TaggedSteps`` holds ``OutputParser``'s steps for them (a mixin: the parser's state is its own)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .parser_text import ToolArgs, ToolEnd, ToolStart, typed

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN = "<function="          # the XML style's head: <function=NAME>
ARG_KEY = "<arg_key>"                 # the GLM style's parameter: <arg_key>K</arg_key><arg_value>V</arg_value>
MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"   # MiniMax-M2's block of calls
INVOKE = '<invoke name="'             # ... each call in it: <invoke name="NAME">
GLM_TAGS = (ARG_KEY, "</arg_key>", "<arg_value>", "</arg_value>")


@dataclass(frozen=True)
class _Tags:
    """A tagged call format: ``head`` (group 1 the tool's name) after ``<tool_call>``, then
    parameters, each ``param`` (group 1 its key; it starts with ``param_open``) and the value's
    text up to ``value_close``; ``between``: tags that mean nothing between parameters;
    ``trim``: the newline each side of a value is the format's, not the value's; ``open`` and
    ``close`` the block's tags; ``call_close``: a call's own end, when one block holds several
    calls (MiniMax's ``</invoke>``)."""

    head: re.Pattern
    param: re.Pattern
    param_open: str
    value_close: str
    between: tuple[str, ...]
    trim: bool
    open: str = TOOL_OPEN
    close: str = TOOL_CLOSE
    call_close: str | None = None

    @property
    def tags(self) -> tuple[str, ...]:
        return (self.param_open, *self.between, *((self.call_close,) if self.call_close else ()), self.close)


_TAGGED = {
    "xml": _Tags(re.compile(r"\s*<function=([^>\n]+)>"), re.compile(r"<parameter=([^>\n]+)>"), "<parameter=",
                 "</parameter>", ("</function>",), True),
    # the name is the text up to a newline or the first tag (not a JSON body: no "{")
    "glm": _Tags(re.compile(r"\s*([^\s<{][^<\n]*?)[ \t]*(?=\n|<arg_key>|</tool_call>)"),
                 re.compile(r"<arg_key>([^<]*)</arg_key>\s*<arg_value>"), ARG_KEY, "</arg_value>", (), False),
    "minimax": _Tags(re.compile(r'\s*' + re.escape(INVOKE) + r'([^"\n]+)">'), re.compile(r'<parameter name="([^"\n]+)">'),
                     '<parameter name="', "</parameter>", (), True, MINIMAX_OPEN, MINIMAX_CLOSE, "</invoke>"),
}


class TaggedSteps:
    """``OutputParser``'s steps inside a tagged format's block (see the module docstring)."""

    def _step_tagged_tool(self, out: list) -> None:
        """Everything after the block's open tag is the body until its structure closes: the
        head (<function=NAME>; GLM: NAME; MiniMax: <invoke name="NAME">), then whole parameters
        (<parameter=KEY>...</parameter>; GLM: <arg_key>KEY</arg_key><arg_value>...</arg_value>;
        a value may hold any tag but its own closing one), then (</function> and) the block's
        close; MiniMax ends each call with </invoke> and may start another in the same block."""
        tags = self.tagged
        self._body, self.buf = self._body + self.buf, ""
        body = self._body
        while True:
            rest = body[self._pos:]
            if not self._started:
                head = tags.head.match(rest)
                if head is None:
                    close = rest.find(tags.close)
                    if close != -1 and self._in_block:    # after a call: the block's end
                        self._end_block(rest[close + len(tags.close):], out)
                    elif close != -1:             # no function head: a JSON body, else the model's text
                        self.buf, self._body = rest[close + len(tags.close):], rest[:close]
                        self._close_tool(out, complete=True)
                        self.mode, self._strip_ws = "content", True
                    return
                self._name, self._started = head.group(1).strip(), True
                self._pos += head.end()
                out.append(ToolStart(self.n_tools, self._name))
                continue
            gap = len(rest) - len(rest.lstrip())
            rest = rest[gap:]
            if rest.startswith(tags.param_open):
                param = tags.param.match(rest)
                close = rest.find(tags.value_close, param.end()) if param else -1
                if close == -1:
                    return                        # the value is still arriving
                self._tagged_param(out, param.group(1).strip(), rest[param.end():close])
                self._pos += gap + close + len(tags.value_close)
            elif any(rest.startswith(t) for t in tags.between):
                self._pos += gap + len(next(t for t in tags.between if rest.startswith(t)))
            elif tags.call_close and rest.startswith(tags.call_close):
                self._pos += gap + len(tags.call_close)
                self._end_call(out)
            elif rest.startswith(tags.close):
                self._end_block(rest[len(tags.close):], out)
                return
            else:
                nxt = [at for at in (rest.find(t) for t in tags.tags) if at > 0]
                if not nxt:
                    return                        # a tag may still be arriving
                self._pos += gap + min(nxt)       # text between the tags: skipped

    def _end_block(self, after: str, out: list) -> None:
        self.buf = after
        self._tagged_close(out, complete=True)
        self.mode, self._strip_ws = "content", True

    def _end_call(self, out: list) -> None:
        out.append(ToolArgs(self.n_tools, "}" if self._params else "{}"))
        out.append(ToolEnd(self.n_tools))
        self.n_tools += 1
        self._in_block += 1
        self._started, self._name, self._params = False, "", 0

    def _tagged_param(self, out: list, key: str, raw: str) -> None:
        if self.tagged.trim and raw.startswith("\n"):
            raw = raw[1:]
        if self.tagged.trim and raw.endswith("\n"):
            raw = raw[:-1]
        schema = (self.schemas.get(self._name) or {}).get("properties", {}).get(key)
        value = json.dumps(typed(raw, schema), ensure_ascii=False)
        out.append(ToolArgs(self.n_tools, ("{" if self._params == 0 else ", ") + json.dumps(key) + ": " + value))
        self._params += 1

    def _tagged_close(self, out: list, *, complete: bool) -> None:
        """The call's arguments object closed and ToolEnd; an unfinished parameter at the end of
        generation is kept as its text so far. Without a function head (and no call before it
        in the block): as a JSON body."""
        if not self._started:
            if not self._in_block:
                self._close_tool(out, complete=complete)
        else:
            if not complete:
                rest = self._body[self._pos:].lstrip()
                param = self.tagged.param.match(rest)
                if param is not None:
                    self._tagged_param(out, param.group(1).strip(), rest[param.end():])
            self._end_call(out)
        self._body, self._started, self._name, self._params = "", False, "", 0
        self._pos, self._in_block = 0, 0
