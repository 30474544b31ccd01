"""Tool calls in DeepSeek's tokens, streamed. DeepSeek-V3.1 / V3.1-Terminus (``style="deepseek"``):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

DeepSeek-V3 (0324) and R1 (0528) (``style="deepseek_fenced"``) put the call's type before the
separator and its arguments in a fenced JSON block after the name:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

``DeepSeekCalls`` reads the text after the block's opening tag as ``parser_list.CallList`` does
(``feed(text) -> (events, rest)``, ``finish``, ``state``, ``unread``, ``index``), either layout
told apart by what follows the separator: a call starts (``ToolStart``) once its name is known,
its arguments stream as they arrive, it ends at its closing tag. Text where a call should begin
that is not one is ``failed``: the text from that call on is ``unread``, shown as the model's
text, so nothing it wrote is lost.

Kimi-K2's calls (``style="kimi"``, ``KimiCalls``) have the same shape in other tokens, the call's id
``functions.NAME:INDEX`` where DeepSeek writes the name:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

and Solar Open's (``style="solar"``, ``SolarCalls``) an id, then the name, in tags of their own:

    <|tool_calls|><|tool_call:begin|>a1b2c3d4e5<|tool_call:name|>get_weather<|tool_call:args|>{"city": "Paris"}<|tool_call:end|>

and Mistral's (``style="mistral"``, ``MistralCalls``: Mistral Small 3.2+, Devstral, Magistral, Mistral
Small 4; its tokenizers' v11 format and later), each call opened by the same tag, no closing one:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{"query": "x"}
"""
from __future__ import annotations

from .parser_text import JsonValueEnd, ToolArgs, ToolEnd, ToolStart, partial_tag

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE, FENCE_END = "```json", "```"
TAGS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, SEP, CALL_END)
KIMI_CALLS_BEGIN, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_SEP = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
KIMI_TAGS = (KIMI_CALLS_BEGIN, KIMI_CALLS_END, KIMI_CALL_BEGIN, KIMI_SEP, KIMI_CALL_END)
KIMI_PREFIX = "functions."
SOLAR_CALLS, SOLAR_END = "<|tool_calls|>", "<|calls|>"
SOLAR_BEGIN, SOLAR_NAME, SOLAR_ARGS, SOLAR_CALL_END = ("<|tool_call:begin|>", "<|tool_call:name|>", "<|tool_call:args|>",
                                                      "<|tool_call:end|>")
SOLAR_TAGS = (SOLAR_CALLS, SOLAR_BEGIN, SOLAR_NAME, SOLAR_ARGS, SOLAR_CALL_END)
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
MISTRAL_THINK = ("[THINK]", "[/THINK]")
MISTRAL_TAGS = (MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID, *MISTRAL_THINK)


class DeepSeekCalls:
    calls_end, call_begin, call_end, sep = CALLS_END, CALL_BEGIN, CALL_END, SEP
    fenced_lead: str | None = "function"   # what V3's fenced calls write before the separator

    def __init__(self, first: int):
        self.index = first           # the next call's index
        self.state = "between"       # between | head | kind | name | args | tail | done | failed
        self.unread = ""
        self._buf = ""               # text not yet taken
        self._raw = ""               # the current call's text taken before its start was shown
        self._lead = ""              # what came before the separator: the name, or "function"
        self._end: JsonValueEnd | None = None

    def feed(self, text: str) -> tuple[list, str]:
        self._buf += text
        out: list = []
        while self.state not in ("done", "failed"):
            before = (self.state, len(self._buf))
            getattr(self, "_" + self.state)(out)
            if (self.state, len(self._buf)) == before:
                break                               # waiting for more text
        if self.state == "done":
            rest, self._buf = self._buf, ""
            return out, rest
        return out, ""

    def finish(self) -> list:
        """The end of generation: a started call ends with its arguments as far as they came;
        one whose name was not yet read stays ``unread``."""
        out: list = []
        if self.state in ("args", "tail"):
            if self.state == "args" and not self._end.started:
                out.append(ToolArgs(self.index, "{}"))
            self._end_call(out)
        elif self.state != "done":
            self.unread = self._raw + self._buf
        return out

    # -- states: each takes from the front of the buffer, or waits ---------------------------
    def _between(self, out: list) -> None:
        body = self._buf.lstrip()
        if body.startswith(self.call_begin):
            self._raw, self._buf, self.state = self.call_begin, body[len(self.call_begin):], "head"
        elif body.startswith(self.calls_end):
            self._buf, self.state = body[len(self.calls_end):], "done"
        elif body and not (self.call_begin.startswith(body) or self.calls_end.startswith(body)):
            self._fail()
        else:
            self._buf = body

    def _head(self, out: list) -> None:
        at = self._buf.find(self.sep)
        if at == -1:
            if self.call_end in self._buf or self.calls_end in self._buf:
                self._fail()
            return
        self._lead, self._raw = self._buf[:at].strip(), self._raw + self._buf[:at + len(self.sep)]
        self._buf, self.state = self._buf[at + len(self.sep):], "kind"

    def _named(self, lead: str) -> str:
        """The tool's name in what precedes the separator ("" when none)."""
        return lead

    def _kind(self, out: list) -> None:
        """After the separator: V3.1's arguments, or V3's name line and fence."""
        body = self._buf.lstrip()
        if not body:
            return
        if self._lead == self.fenced_lead and body[0] not in "{[" and not body.startswith(self.call_end):
            self.state = "name"
        elif not self._named(self._lead):
            self._fail()
        else:
            self._start(self._named(self._lead), out)
            self._buf = body

    def _name(self, out: list) -> None:
        at = self._buf.find(FENCE)
        if at == -1:
            if self.call_end in self._buf or self._buf.count("\n") > 1:
                self._fail()
            return
        name = self._buf[:at].strip()
        if not name:
            self._fail()
            return
        self._buf = self._buf[at + len(FENCE):]
        self._start(name, out)

    def _args(self, out: list) -> None:
        if not self._end.started:                   # whitespace before the value is not argument text
            self._buf = self._buf.lstrip()
            if not self._buf:
                return
            if self._buf[0] not in "{[":            # no arguments written (or not JSON): none
                out.append(ToolArgs(self.index, "{}"))
                self.state = "tail"
                return
        n = self._end.feed(self._buf)
        if n:
            out.append(ToolArgs(self.index, self._buf[:n]))
            self._buf = self._buf[n:]
        if self._end.done:
            self.state = "tail"

    def _tail(self, out: list) -> None:
        """After the arguments: V3's closing fence, if any, and the call's closing tag."""
        at = self._buf.find(self.call_end)
        if at == -1:
            self._buf = self._buf[len(self._buf) - partial_tag(self._buf, (self.call_end,)):]
            return
        self._buf = self._buf[at + len(self.call_end):]
        self._end_call(out)
        self.state, self._raw = "between", ""

    # -- helpers -------------------------------------------------------------------------------
    def _start(self, name: str, out: list) -> None:
        out.append(ToolStart(self.index, name))
        self.state, self._end, self._raw = "args", JsonValueEnd(), ""

    def _end_call(self, out: list) -> None:
        out.append(ToolEnd(self.index))
        self.index += 1

    def _fail(self) -> None:
        self.state, self.unread, self._buf = "failed", self._raw + self._buf, ""


class KimiCalls(DeepSeekCalls):
    """Kimi-K2's calls: the id ``functions.NAME:INDEX`` before the separator names the tool (the
    prefix and the index optional, a dotted name kept whole)."""
    calls_end, call_begin, call_end, sep = KIMI_CALLS_END, KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_SEP
    fenced_lead = None

    def _named(self, lead: str) -> str:
        return kimi_name(lead)


class SolarCalls(DeepSeekCalls):
    """Solar Open's calls, after ``<|tool_calls|>``: ``<|tool_call:begin|>ID<|tool_call:name|>NAME
    <|tool_call:args|>{...}<|tool_call:end|>``, one after another until ``<|calls|>`` (an end of
    generation, so usually never seen)."""
    calls_end, call_begin, call_end, sep = SOLAR_END, SOLAR_BEGIN, SOLAR_CALL_END, SOLAR_ARGS
    fenced_lead = None

    def _named(self, lead: str) -> str:
        _, tag, name = lead.partition(SOLAR_NAME)
        return name.strip() if tag else ""


class MistralCalls(DeepSeekCalls):
    """Mistral's calls after ``[TOOL_CALLS]``: ``NAME[ARGS]{...}`` (an id after ``[CALL_ID]`` before
    ``[ARGS]`` passed over), the next call after another ``[TOOL_CALLS]``; no closing tag, so a call
    ends with its arguments' JSON value and the block with anything but a next call (the text
    after it is the model's, shown). The older list form, ``[TOOL_CALLS][{...}]``, is not read: it
    stays the model's text."""
    calls_end, call_begin, call_end, sep = "", MISTRAL_CALLS, "", MISTRAL_ARGS
    fenced_lead = None

    def __init__(self, first: int):
        super().__init__(first)
        self.state = "head"                  # the opening tag was the first call's

    def _head(self, out: list) -> None:
        at = self._buf.find(self.sep)
        if at == -1:
            if "{" in self._buf or "\n" in self._buf or self._buf.lstrip().startswith("[") or len(self._buf) > 256:
                self._fail()                 # no name holds these (the list form starts with "["): not a call
            return
        self._lead, self._raw = self._buf[:at].strip(), self._raw + self._buf[:at + len(self.sep)]
        self._buf, self.state = self._buf[at + len(self.sep):], "kind"

    def _named(self, lead: str) -> str:
        return lead.partition(MISTRAL_CALL_ID)[0].strip()

    def finish(self) -> list:
        """As ``DeepSeekCalls.finish``; a call whose ``[ARGS]`` ended the generation is a call
        without arguments."""
        if self.state == "kind" and not self._buf.strip() and self._named(self._lead):
            out: list = []
            self._start(self._named(self._lead), out)
            out.append(ToolArgs(self.index, "{}"))
            self._end_call(out)
            return out
        return super().finish()

    def _tail(self, out: list) -> None:
        self._end_call(out)
        self.state, self._raw = "between", ""

    def _between(self, out: list) -> None:
        body = self._buf.lstrip()
        if body.startswith(self.call_begin):
            self._raw, self._buf, self.state = self.call_begin, body[len(self.call_begin):], "head"
        elif body and not self.call_begin.startswith(body):
            self.state = "done"              # the text after the calls: the model's
        else:
            self._buf = body


def kimi_name(call_id: str) -> str:
    """``functions.get_weather:0`` -> ``get_weather``."""
    name = call_id.strip().removeprefix(KIMI_PREFIX)
    head, colon, index = name.rpartition(":")
    return head if colon and index.isdigit() else name
