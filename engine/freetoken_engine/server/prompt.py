"""Chat messages -> prompt token ids through the model's own chat template.

Both protocol modules first convert their messages to the Hugging Face chat-template shape
(``{"role", "content", "tool_calls": [{"type": "function", "function": {"name", "arguments":
dict}}], "tool_call_id", "reasoning_content"}``) and their tools to ``{"type": "function",
"function": {...}}``; ``build_prompt`` renders and encodes them.

System messages: those the conversation starts with are merged into one; a later one stays
where it is unless the template refuses it (Qwen3.5's takes a system message only first), then
it is rendered as a user message. Agents send both: Codex developer messages, Claude Code
system messages between the turns.

Tool choice: ``"none"`` hides the tools from the template and disables tool-call parsing;
``"auto"`` shows them; ``"required"`` and a named tool additionally *pre-fill* the start of the
model's answer (``<tool_call>\\n{"name": "`` or ``...{"name": "f", "arguments": ``; in the XML
style ``<tool_call>\\n<function=`` or ``...<function=f>\\n``; in GLM's ``<tool_call>`` or
``<tool_call>f`` and what its template writes after a name; in MiniMax-M2's
``<minimax:tool_call>\\n<invoke name="`` or ``...<invoke name="f">\\n``), so the model continues
inside a tool call.

The tool-call style is the chat template's: one that writes ``<function=`` (Qwen3.5/3.6,
Qwen3-Coder) gets the XML parser, one that writes ``<arg_key>`` (GLM-4.5/4.6/4.7) the GLM one,
any other the Hermes JSON one (``parser.py``). This steers by prompt, it is not constrained decoding: the
arguments are what the model writes (OpenAI documents that arguments may be invalid JSON too).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from .errors import ApiError
from .parser_deepseek import (CALL_BEGIN, CALLS_BEGIN, FENCE, KIMI_CALL_BEGIN, KIMI_CALLS_BEGIN, KIMI_PREFIX, KIMI_SEP,
                              MISTRAL_ARGS, MISTRAL_CALLS,
                              SEP, SOLAR_ARGS, SOLAR_BEGIN, SOLAR_CALLS, SOLAR_NAME)
from .parser_harmony import CHANNEL as HARMONY_CHANNEL
from .parser_harmony import CONSTRAIN as HARMONY_CONSTRAIN
from .parser_harmony import MESSAGE as HARMONY_MESSAGE
from .parser import (ARG_KEY, COHERE_OPEN, ERNIE_CLOSE, ERNIE_OPEN, FUNCTION_OPEN, GRANITE_OPEN, HUNYUAN_OPEN,
                     INVOKE, MINIMAX_OPEN, PYTHONIC_OPEN, THINK_CLOSE, TOOL_OPEN, think_tags)


#: reasoning efforts a template may take as ``reasoning_effort`` (gpt-oss's: its system message's
#: "Reasoning: low|medium|high"); the API's "none" and "minimal" switch thinking off instead
EFFORTS = ("low", "medium", "high")

#: what a tool's result says in place of an image or file part: the models served here read
#: text only, and refusing the result would end an agent's session (Codex's view_image, Claude
#: Code reading an image file)
NON_TEXT_RESULT = "[{kind} omitted: this model reads text only]"


@dataclass(frozen=True)
class Prompt:
    """What the generation needs besides sampling: ids, and the parser's starting state."""

    ids: list[int]
    in_reasoning: bool        # the template opened <think>: output starts as reasoning
    prefill: str              # text already "written" by the assistant (fed to the parser first)
    tools: bool               # parse tool calls
    style: str = "json"       # the tool calls' format: "json" (Hermes), "xml" (Qwen3.5, Qwen3-Coder), "glm", "minimax",
    #                           "granite", "pythonic" (LFM2), "hunyuan", "deepseek" (V3.1), "deepseek_fenced" (V3, R1),
    #                           "kimi" (Kimi-K2), "solar" (Solar Open), "ernie" (ERNIE-4.5: json in <response> tags),
    #                           "harmony" (gpt-oss: channels; parser_harmony.py), "cohere" (Command A), "mistral"
    schemas: dict | None = None   # tool name -> its parameters' JSON Schema (types the XML values)
    strict: frozenset[str] = frozenset()   # tools whose calls must follow their schema (``strict``)
    forced: str | None = None     # the prompt opened a tool call: "required", or the named tool
    parallel: bool = True         # a forced "required" answer may hold more than one call


def tool_style(tokenizer) -> str:
    """The tool-call format the model's chat template teaches: "minimax" when it writes
    ``<minimax:tool_call>``, "granite" when it writes ``<|tool_call|>``, "pythonic" when it writes
    ``<|tool_call_start|>``, "hunyuan" when it writes ``<tool_calls>``, "deepseek" / "deepseek_fenced" when it writes ``<｜tool▁calls▁begin｜>``
    (the second also a fenced JSON block), "harmony" (gpt-oss) when it writes ``<|channel|>``, "cohere" when it
    writes ``<|START_ACTION|>``, "mistral" when it writes ``[TOOL_CALLS]``, "kimi" when it writes ``<|tool_calls_section_begin|>``, "solar" when it
    writes ``<|tool_call:begin|>``, "xml" when it writes
    ``<function=``, "glm" when it writes ``<arg_key>``, "ernie" (Hermes JSON calls, the answer in
    ``<response>`` tags that are not shown) when it writes ``<response>`` or the tokenizer has it and
    ``</response>`` as added tokens (ERNIE-4.5-Thinking), else "json"."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if HARMONY_CHANNEL in template:
        return "harmony"
    if COHERE_OPEN in template:
        return "cohere"
    if MISTRAL_CALLS in template:
        return "mistral"
    if KIMI_CALLS_BEGIN in template:
        return "kimi"
    if SOLAR_BEGIN in template:
        return "solar"
    if MINIMAX_OPEN in template:
        return "minimax"
    if GRANITE_OPEN in template:
        return "granite"
    if PYTHONIC_OPEN in template:
        return "pythonic"
    if HUNYUAN_OPEN in template:
        return "hunyuan"
    if CALLS_BEGIN in template:        # DeepSeek's calls: V3 and R1 fence their arguments, V3.1 does not
        return "deepseek_fenced" if FENCE in template else "deepseek"
    if FUNCTION_OPEN in template:
        return "xml"
    if ARG_KEY in template:
        return "glm"
    if ERNIE_OPEN in template or {ERNIE_OPEN, ERNIE_CLOSE} <= getattr(tokenizer, "added_tokens", frozenset()):
        return "ernie"
    return "json"


_PROBE = "probe_tool"


@functools.lru_cache(maxsize=8)
def glm_after_name(tokenizer) -> str:
    """What the chat template writes between a GLM call's name and its first ``<arg_key>``: a
    newline (GLM-4.5/4.6) or nothing (GLM-4.7), read off a call the template renders itself; a
    newline when it cannot tell."""
    call = {"type": "function", "function": {"name": _PROBE, "arguments": {"a": "b"}}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"},
                                              {"role": "assistant", "content": "", "tool_calls": [call]}],
                                             add_generation_prompt=False)
    except Exception:   # noqa: BLE001  a template that refuses the probe: the GLM-4.5 layout
        return "\n"
    at = text.find(TOOL_OPEN + _PROBE)
    rest = text[at + len(TOOL_OPEN + _PROBE):] if at != -1 else ""
    gap = rest[: rest.find(ARG_KEY)] if ARG_KEY in rest else "\n"
    return gap if not gap.strip() else "\n"


# each format's pre-fill of a required call (ending where the tool's name is written), and what a
# named call writes after that: its name and the text up to where its arguments start
def _json_named(name: str, after: str) -> str:
    """A JSON call object's rest after ``{"name": "``: the name, then up to its arguments."""
    return json.dumps(name)[1:] + ', "arguments": '


SOLAR_ID = "0000000000"
_PREFILLS = {
    "json": (f'{TOOL_OPEN}\n{{"name": "', _json_named),
    "ernie": (f'{TOOL_OPEN}\n{{"name": "', _json_named),
    "granite": (f'{GRANITE_OPEN}[{{"name": "', _json_named),
    "hunyuan": (f'{HUNYUAN_OPEN}[{{"name": "', _json_named),
    "cohere": (f'{COHERE_OPEN}[{{"tool_call_id": "0", "tool_name": "', lambda name, after: json.dumps(name)[1:] +
               ', "parameters": '),
    "xml": (f"{TOOL_OPEN}\n{FUNCTION_OPEN}", lambda name, after: f"{name}>\n"),
    "glm": (TOOL_OPEN, lambda name, after: name + after),
    "minimax": (f"{MINIMAX_OPEN}\n{INVOKE}", lambda name, after: f'{name}">\n'),
    "pythonic": (f"{PYTHONIC_OPEN}[", lambda name, after: f"{name}("),
    "deepseek": (CALLS_BEGIN + CALL_BEGIN, lambda name, after: name + SEP),
    "deepseek_fenced": (f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}", lambda name, after: f"{name}\n{FENCE}\n"),
    "kimi": (KIMI_CALLS_BEGIN + KIMI_CALL_BEGIN + KIMI_PREFIX, lambda name, after: f"{name}:0{KIMI_SEP}"),
    "mistral": (MISTRAL_CALLS, lambda name, after: name + MISTRAL_ARGS),
    "harmony": (f"{HARMONY_CHANNEL}commentary to=functions.",
                lambda name, after: f"{name} {HARMONY_CONSTRAIN}json{HARMONY_MESSAGE}"),
    # Solar Open writes a 10-character id before the name: the pre-fill writes one of its own
    "solar": (SOLAR_CALLS + SOLAR_BEGIN + SOLAR_ID + SOLAR_NAME, lambda name, after: name + SOLAR_ARGS),
}
#: what ends a style's open reasoning before a forced call's pre-fill, where it is not "</think>\n\n"
_REASONING_END = {"solar": "<|end|><|begin|>assistant", "cohere": "<|END_THINKING|>", "mistral": "[/THINK]"}


def tool_prefill(tool_choice: str | None, named: str | None, style: str = "json", after_name: str = "\n") -> str:
    """What the answer starts with when ``tool_choice`` forces a call: ``required`` opens a call
    up to its tool's name, a ``named`` tool's call up to where its arguments start (GLM: the
    template's ``after_name`` text after the name); nothing otherwise."""
    head, named_part = _PREFILLS[style]
    if named is not None:
        return head + named_part(named, after_name)
    return head if tool_choice == "required" else ""


def build_prompt(tokenizer, messages: list[dict], tools: list[dict] | None, *,
                 tool_choice: str = "auto", named_tool: str | None = None,
                 template_kwargs: dict | None = None, continue_text: str = "",
                 parallel_calls: bool = True) -> Prompt:
    """Render ``messages`` with the chat template; raise ApiError(400) if the template refuses
    them (a template may reject, e.g., a conversation that does not alternate roles).
    ``continue_text`` is an assistant pre-fill: the answer continues it (it is not returned)."""
    use_tools = bool(tools) and tool_choice != "none"
    kwargs = dict(template_kwargs or {})
    render = functools.partial(tokenizer.apply_chat_template, tools=tools if use_tools else None,
                               add_generation_prompt=True, **kwargs)
    style = tool_style(tokenizer)
    if style == "kimi":
        messages = kimi_call_ids(messages)
    if style == "harmony":      # gpt-oss's template renders an assistant's reasoning from ``thinking``
        messages = [dict(m, thinking=m["reasoning_content"]) if m.get("reasoning_content") else m for m in messages]
    try:
        text = _rendered(render, _leading_system_merged(messages))
    except ApiError:
        raise
    except Exception as exc:  # jinja2 TemplateError, or raise_exception() inside the template
        raise ApiError(400, f"the model's chat template rejected these messages: {exc}",
                       param="messages") from exc
    in_reasoning = text.rstrip().endswith(think_tags(style)[0])
    after = glm_after_name(tokenizer) if style == "glm" and named_tool is not None else "\n"
    prefill = tool_prefill(tool_choice, named_tool, style, after) if use_tools and not continue_text else ""
    if prefill and in_reasoning:
        prefill = _REASONING_END.get(style, f"{THINK_CLOSE}\n\n") + prefill
    if continue_text:
        text, in_reasoning = text + continue_text, False
    # the template already wrote BOS and friends: do not add special tokens again
    ids = encode_text(tokenizer, text + prefill, add_special_tokens=False)
    functions = [t["function"] for t in tools or () if isinstance(t.get("function"), dict)
                 and "name" in t["function"]]
    names = [f["name"] for f in functions]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:   # a call names its tool: two of one name would share one schema
        raise ApiError(400, f"tools: the tool name {twice!r} is given twice; tool names must be unique",
                       param="tools")
    schemas = {f["name"]: f.get("parameters") or {} for f in functions}
    forced = (named_tool or tool_choice) if prefill else None
    return Prompt(ids=list(ids), in_reasoning=in_reasoning, prefill=prefill, tools=use_tools,
                  style=style, schemas=schemas, forced=forced, parallel=parallel_calls,
                  strict=frozenset(f["name"] for f in functions if f.get("strict")))


def kimi_call_ids(messages: list[dict]) -> list[dict]:
    """The history with each call's id as Kimi-K2 wrote it, ``functions.NAME:INDEX`` (the index
    counting the calls of its turn), and each tool result under its call's: the server gives calls
    ids of the API's kind (``call_...``, ``toolu_...``), and the template renders the id where the
    model was trained to read its own (``## Return of functions.NAME:INDEX``)."""
    out, names, pending = [], {}, []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [dict(c, id=f"{KIMI_PREFIX}{c['function']['name']}:{i}") for i, c in enumerate(m["tool_calls"])]
            names = {c.get("id"): new["id"] for c, new in zip(m["tool_calls"], calls)}
            pending = [c["id"] for c in calls]
            m = dict(m, tool_calls=calls)
        elif m["role"] == "tool":
            # a result without an id answers the next unanswered call (tool_turns.check_tool_turns)
            new = names.get(m.get("tool_call_id")) if m.get("tool_call_id") is not None else \
                (pending[0] if pending else None)
            if new is not None:
                m = dict(m, tool_call_id=new)
                pending = [p for p in pending if p != new]
        out.append(m)
    return out


def _leading_system_merged(messages: list[dict]) -> list[dict]:
    """The system messages the conversation starts with as one (templates take one, first)."""
    lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if lead < 2:
        return messages
    text = "\n\n".join(m["content"] for m in messages[:lead] if m.get("content"))
    return [{"role": "system", "content": text}] + messages[lead:]


def _rendered(render, messages: list[dict]) -> str:
    """``render(messages)``; a template that refuses a system message after the first gets the
    later ones as user messages."""
    try:
        return render(messages)
    except Exception:      # noqa: BLE001  the template's own error, raised again if no late system
        if not any(m["role"] == "system" for m in messages[1:]):
            raise
    return render([dict(m, role="user") if i and m["role"] == "system" else m for i, m in enumerate(messages)])


def encode_text(tokenizer, text: str, *, add_special_tokens: bool, param: str = "messages"):
    """Encode, refusing text that is not valid Unicode (JSON allows lone surrogates such as
    ``"\\ud800"``; the tokenizer does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{param}: the text is not valid Unicode ({exc.reason} at "
                            f"character {exc.start})", param=param) from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def arguments_object(raw, where: str) -> dict | str:
    """A tool call's arguments as the templates expect: a dict, parsed from the JSON string the
    OpenAI API carries. Text that is not a JSON object is passed on as it is (templates accept
    strings): it is usually this server's own earlier output, and refusing it would break the
    client's conversation."""
    if isinstance(raw, dict):
        return raw
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except ValueError:
            return raw
        return value if isinstance(value, dict) else raw
    raise ApiError(400, f"{where}: arguments must be a JSON object or a string", param=where)


def check_tool_schema(name: str, schema, where: str) -> None:
    """Malformed tool definitions are a 400 that names the tool."""
    if not isinstance(schema, dict):
        raise ApiError(400, f"{where}: the parameters of tool '{name}' must be a JSON Schema "
                            "object", param=where)
    kind = schema.get("type", "object")
    if kind != "object":
        raise ApiError(400, f"{where}: the parameters of tool '{name}' must have type 'object', "
                            f"got {kind!r}", param=where)
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise ApiError(400, f"{where}: 'properties' of tool '{name}' must be an object",
                       param=where)
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"{where}: schema of tool '{name}' is not JSON: {exc}",
                       param=where) from None
