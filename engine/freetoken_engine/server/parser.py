"""Split a model's raw output into reasoning, content and tool calls, incrementally.

The model writes one text stream in its own format, Qwen3 / Hermes (``style="json"``):

    <think>reasoning...</think>\n\ncontent <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>

or Qwen3.5/3.6 and Qwen3-Coder's (``style="xml"``), each parameter's value as raw text:

    <tool_call>\n<function=f>\n<parameter=path>\nsrc/app.py\n</parameter>\n</function>\n</tool_call>

or GLM-4.5/4.6/4.7's (``style="glm"``), the same idea in other tags (GLM-4.7 without the newlines):

    <tool_call>f\n<arg_key>path</arg_key>\n<arg_value>src/app.py</arg_value>\n</tool_call>

or MiniMax-M2's (``style="minimax"``), one block holding each call of the turn:

    <minimax:tool_call>\n<invoke name="f">\n<parameter name="path">src/app.py</parameter>\n</invoke>\n</minimax:tool_call>

or Granite 3.x's (``style="granite"``), every call of the turn in one JSON list after a special token
(``parser_list.CallList``):

    <|tool_call|>[{"name": "f", "arguments": {...}}, {"name": "g", "arguments": {...}}]

or LFM2's (``style="pythonic"``), Python calls in a block (``parser_pythonic.PythonicBlock``):

    <|tool_call_start|>[f(path="src/app.py", n=3), g()]<|tool_call_end|>

or Hunyuan-A13B's (``style="hunyuan"``), Granite's list between tags, the answer itself between
``<answer>`` tags that are not shown (ERNIE-4.5's, ``style="ernie"``, is Hermes JSON calls and the
answer between ``<response>`` tags, not shown either):

    <answer>\ncontent<tool_calls>[{"name": "f", "arguments": {...}}]</tool_calls></answer>

or DeepSeek-V3.1's (``style="deepseek"``; V3 and R1's, with the arguments fenced, ``"deepseek_fenced"``),
calls between DeepSeek's tokens (``parser_deepseek.DeepSeekCalls``):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"path": "src/app.py"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

or Kimi-K2's (``style="kimi"``), the same in Moonshot's tokens, each call named by its id
(``parser_deepseek.KimiCalls``):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"path": "src/app.py"}<|tool_call_end|><|tool_calls_section_end|>

or Solar Open's (``style="solar"``), reasoning between ``<|think|>`` and ``<|end|>``, each part of the
answer an assistant turn of its own (``<|begin|>assistant<|content|>`` text, not shown), the calls
after ``<|tool_calls|>``, each with an id before its name (``parser_deepseek.SolarCalls``):

    <|think|>...<|end|><|begin|>assistant<|tool_calls|><|tool_call:begin|>a1b2c3d4e5<|tool_call:name|>f<|tool_call:args|>{...}<|tool_call:end|>

An XML, GLM or MiniMax call's arguments become a JSON object, each value typed by the tool's JSON Schema
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

import functools

from .parser_deepseek import (CALLS_BEGIN, KIMI_CALLS_BEGIN, KIMI_TAGS, MISTRAL_CALLS, MISTRAL_TAGS, MISTRAL_THINK,
                              SOLAR_CALLS, SOLAR_TAGS, DeepSeekCalls, KimiCalls, MistralCalls, SolarCalls)
from .parser_deepseek import TAGS as DEEPSEEK_TAGS
from .parser_harmony import CHANNEL, HarmonyParser
from .parser_harmony import TAGS as HARMONY_TAGS
from .parser_list import COHERE_HEAD, CallList
from .parser_pythonic import PYTHONIC_CLOSE, PYTHONIC_OPEN, PythonicBlock
from .parser_tagged import (_TAGGED, ARG_KEY, FUNCTION_OPEN, GLM_TAGS, INVOKE, MINIMAX_CLOSE, MINIMAX_OPEN, TOOL_CLOSE,
                            TOOL_OPEN, TaggedSteps)
from .parser_text import (CALL_HEAD, Content, JsonValueEnd, Reasoning, ToolArgs, ToolEnd, ToolStart, parse_whole,
                          partial_tag, unquote)

__all__ = ["ARG_KEY", "FUNCTION_OPEN", "GLM_TAGS", "GRANITE_OPEN", "HUNYUAN_CLOSE", "HUNYUAN_OPEN", "INVOKE",
           "MINIMAX_CLOSE", "MINIMAX_OPEN", "PYTHONIC_CLOSE", "PYTHONIC_OPEN", "THINK_CLOSE", "THINK_OPEN", "TOOL_CLOSE", "TOOL_OPEN", "Content",
           "Event", "OutputParser", "Reasoning", "ToolArgs", "ToolEnd", "ToolStart", "format_tags", "opening_tag"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
GRANITE_OPEN = "<|tool_call|>"        # Granite's token before its JSON list of calls (no closing tag)
HUNYUAN_OPEN, HUNYUAN_CLOSE = "<tool_calls>", "</tool_calls>"
ERNIE_OPEN, ERNIE_CLOSE = "<response>", "</response>"   # ERNIE-4.5's answer wrapper (its calls are Hermes JSON)
COHERE_OPEN, COHERE_CLOSE = "<|START_ACTION|>", "<|END_ACTION|>"      # Cohere's JSON list of calls between them
COHERE_THINK = ("<|START_THINKING|>", "<|END_THINKING|>")
COHERE_RESPONSE = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")          # its answer's wrapper, not shown
# tags a style's content carries that are not the model's text: dropped where they stand
_DROPPED = {"hunyuan": ("<answer>", "</answer>", HUNYUAN_CLOSE), "ernie": (ERNIE_OPEN, ERNIE_CLOSE),
            "solar": ("<|end|>", "<|begin|>assistant", "<|content|>"), "cohere": (*COHERE_RESPONSE, COHERE_CLOSE)}
# a style's reasoning tags, where they are not <think> and </think>
_THINK = {"solar": ("<|think|>", "<|end|>"), "cohere": COHERE_THINK, "mistral": MISTRAL_THINK}
#: styles whose tags are kept for the parser with or without tools: they also tell the reasoning
#: and the answer apart (special tokens in their tokenizers)
ALWAYS_KEPT = ("harmony", "cohere", "mistral")


def think_tags(style: str) -> tuple[str, str]:
    """The tags that open and close ``style``'s reasoning."""
    return _THINK.get(style, (THINK_OPEN, THINK_CLOSE))


# styles read by a reader object after their opening tag: (opening tag, the tags a stream
# decoder keeps, the reader)
_LISTED = {"granite": (GRANITE_OPEN, (GRANITE_OPEN,), CallList),
           "pythonic": (PYTHONIC_OPEN, (PYTHONIC_OPEN, PYTHONIC_CLOSE), PythonicBlock),
           "hunyuan": (HUNYUAN_OPEN, (HUNYUAN_OPEN, HUNYUAN_CLOSE), CallList),
           "deepseek": (CALLS_BEGIN, DEEPSEEK_TAGS, DeepSeekCalls),
           "deepseek_fenced": (CALLS_BEGIN, DEEPSEEK_TAGS, DeepSeekCalls),
           "kimi": (KIMI_CALLS_BEGIN, KIMI_TAGS, KimiCalls),
           "solar": (SOLAR_CALLS, SOLAR_TAGS, SolarCalls),
           "cohere": (COHERE_OPEN, (COHERE_OPEN, COHERE_CLOSE, *COHERE_THINK, *COHERE_RESPONSE),
                      functools.partial(CallList, head=COHERE_HEAD)),
           "mistral": (MISTRAL_CALLS, MISTRAL_TAGS, MistralCalls)}


def opening_tag(style: str) -> str:
    """The tag before a tool call (or a block or list of them) in ``style``."""
    if style == "harmony":
        return CHANNEL
    return _TAGGED[style].open if style in _TAGGED else _LISTED[style][0] if style in _LISTED else TOOL_OPEN


def format_tags(style: str) -> tuple[str, ...]:
    """The tags that open and close ``style``'s calls (Granite's list has no closing tag)."""
    if style in _LISTED:
        return _LISTED[style][1]
    if style == "harmony":
        return HARMONY_TAGS
    tags = _TAGGED.get(style)
    return (tags.open, tags.close) if tags else (TOOL_OPEN, TOOL_CLOSE)


Event = Reasoning | Content | ToolStart | ToolArgs | ToolEnd


def output_parser(*, tools: bool, in_reasoning: bool = False, style: str = "json",
                  schemas: dict[str, dict] | None = None):
    """The parser of ``style``'s answers: gpt-oss's harmony messages (``parser_harmony``) or the
    tagged formats (``OutputParser``); both have ``feed`` and ``finish``."""
    if style == "harmony":
        return HarmonyParser(tools=tools)
    return OutputParser(tools=tools, in_reasoning=in_reasoning, style=style, schemas=schemas)


class OutputParser(TaggedSteps):
    """Incremental reasoning / content / tool-call splitter (see the module docstring).

    ``in_reasoning``: the prompt already opened ``<think>`` (templates that force thinking), so
    output starts as reasoning. ``tools``: parse ``<tool_call>`` blocks; without tools the tags
    are ordinary content.
    """

    def __init__(self, *, tools: bool, in_reasoning: bool = False, style: str = "json",
                 schemas: dict[str, dict] | None = None):
        if style not in ("json", "ernie", *_LISTED, *_TAGGED):
            raise ValueError(f"tool-call style {style!r}: one of json, ernie, {', '.join((*_LISTED, *_TAGGED))}")
        self.tools, self.xml, self.schemas = tools, style == "xml", schemas or {}
        self.tagged = _TAGGED.get(style)   # None: Hermes JSON bodies, or a reader's style (_LISTED)
        self.listed: CallList | PythonicBlock | DeepSeekCalls | None = None   # a list or block being read
        self.reader = _LISTED[style][2] if style in _LISTED else None
        self.tool_open = opening_tag(style)
        self.dropped = _DROPPED.get(style, ())
        self.think_open, self.think_close = think_tags(style)
        self.tool_close = self.tagged.close if self.tagged else TOOL_CLOSE
        self._pos = 0                 # tagged: how far into the block's body is read
        self._in_block = 0            # tagged: calls ended in the current block
        self.mode = "reasoning" if in_reasoning else "content"
        self.buf = ""
        self.n_tools = 0
        self._strip_ws = False        # drop the blank line(s) a model writes after </think>
        self._begun = False           # anything shown yet (GLM writes "\n" before its <think>: dropped)
        self._think_unclosed = False  # a tool call ended the reasoning: a later </think> is dropped
        self._body = ""               # current tool-call body
        self._started = False         # current tool call's ToolStart emitted
        self._args_end: JsonValueEnd | None = None
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
            elif self.tagged:
                self._step_tagged_tool(out)
            elif self.reader:
                self._step_listed_tool(out)
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
        elif self.mode == "tool" and self.tagged:
            self._body += rest
            self._tagged_close(out, complete=False)
        elif self.mode == "tool" and self.reader:
            self._step_listed_tool(out, rest)
            if self.mode == "tool":
                out += self.listed.finish()
                self._listed_end(out, self.listed.unread)
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
        self._begun = True
        out.append(Content(text))

    def _step_content(self, out: list[Event]) -> None:
        if not self._begun and not self.buf.strip():
            return                                # leading whitespace: shown with what follows it
        tags = (self.think_open, self.tool_open) if self.tools else (self.think_open,)
        if self._think_unclosed:
            tags += (self.think_close,)
        tags += self.dropped
        hits = [(self.buf.find(t), t) for t in tags]
        hits = [(at, t) for at, t in hits if at != -1]
        if hits:
            at, tag = min(hits)
            before = self.buf[:at].rstrip() if tag in self.dropped and tag.startswith("</") else self.buf[:at]
            if before and (self._begun or tag != self.think_open or before.strip()):
                self._emit_content(before, out)
            self.buf = self.buf[at + len(tag):]
            if tag == self.think_open:
                self.mode, self._think_unclosed = "reasoning", False
            elif tag == self.think_close and self._think_unclosed:     # the reasoning's late close: dropped
                self._strip_ws, self._think_unclosed = True, False
            elif tag in self.dropped:             # a wrapper (Hunyuan's <answer>), not the model's text
                self._strip_ws = True
            else:
                self._open_tool()
            return
        keep = partial_tag(self.buf, tags)
        if self.dropped:     # whitespace before a wrapper's closing tag (Hunyuan's "\n</answer>") is its
            keep = len(self.buf) - len(self.buf[:len(self.buf) - keep].rstrip())
        if len(self.buf) > keep:
            self._emit_content(self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]

    def _open_tool(self) -> None:
        self.mode, self._body, self._started = "tool", "", False
        self._args_end, self._args_done, self._name, self._params = None, False, "", 0
        self._pos, self._in_block = 0, 0
        self.listed = self.reader(self.n_tools) if self.reader else None

    def _step_reasoning(self, out: list[Event]) -> None:
        tags = (self.think_close, TOOL_OPEN) if self.xml and self.tools else (self.think_close,)
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
        keep = partial_tag(self.buf, tags)
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
        upto = at if at != -1 else len(self.buf) - partial_tag(self.buf, (TOOL_CLOSE,))
        if not self._started:
            head = CALL_HEAD.match(self._body + self.buf[:upto])
            if head is not None:
                used = head.end() - len(self._body)
                self._body += self.buf[:used]
                self.buf = self.buf[used:]
                self._started, self._args_end = True, JsonValueEnd()
                out.append(ToolStart(self.n_tools, unquote(head.group(1))))
                return
        self._body += self.buf[:upto]
        if at != -1:
            self.buf = self.buf[at + len(TOOL_CLOSE):]
            self._close_tool(out, complete=True)
            self.mode, self._strip_ws = "content", True
        else:
            self.buf = self.buf[upto:]

    # -- Granite's list of calls, LFM2's block of Python calls -------------------------------
    def _step_listed_tool(self, out: list[Event], more: str = "") -> None:
        """The list after ``<|tool_call|>`` (``parser_list.CallList``) or the block after
        ``<|tool_call_start|>`` (``parser_pythonic.PythonicBlock``); once it closes, content
        again. Text that is not such calls is shown as the model's text, with the tag when no
        call came before it."""
        evs, rest = self.listed.feed(self.buf + more)
        self.buf = ""
        out += evs
        if self.listed.state == "done":
            self._listed_end(out, "")
            self.buf = rest
        elif self.listed.state == "failed":
            self._listed_end(out, self.listed.unread)

    def _listed_end(self, out: list[Event], unread: str) -> None:
        first = self.n_tools
        self.n_tools, self.listed = self.listed.index, None
        if unread:
            self._emit_content((self.tool_open if self.n_tools == first else "") + unread, out)
        # after whole calls the blank line the model writes goes; text that was not calls goes on as it is
        self.mode, self._strip_ws = "content", not unread

    # -- tool calls ------------------------------------------------------------------------
    def _close_tool(self, out: list[Event], *, complete: bool) -> None:
        if self._started:
            out.append(ToolEnd(self.n_tools))
            self.n_tools += 1
        else:
            call = parse_whole(self._body)
            if call is None:
                raw = self.tool_open + self._body + (self.tool_close if complete else "")
                self._emit_content(raw, out)
            else:
                name, args = call
                out += [ToolStart(self.n_tools, name), ToolArgs(self.n_tools, args),
                        ToolEnd(self.n_tools)]
                self.n_tools += 1
        self._body, self._started, self._args_end, self._args_done = "", False, None, False
