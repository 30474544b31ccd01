"""Grammars that hold tool calls to their tools' schemas, in the chat template's own format.

Four formats (``prompt.tool_style``; MiniMax-M2's fifth has no grammar yet: its forced calls
are held by the pre-fill alone and a ``strict`` tool is a 400):

- JSON (Hermes; Qwen3): ``<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>``;
  the arguments are JSON for the tool's schema, spaced as the templates' ``tojson`` writes it.
- XML (Qwen3.5/3.6, Qwen3-Coder): ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n
  </parameter>\\n...</function>\\n</tool_call>``; a string value is any text without
  ``\\n</parameter>``, a string enum one of its values, any other value JSON for its schema;
  the schema's properties come in its order, the required ones always, the others optionally.
- GLM (GLM-4.5/4.6/4.7): ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>
  \\n...</tool_call>`` (each newline optional: GLM-4.7 writes none); values as in the XML format,
  a string any text up to ``</arg_value>``. Tags that are tokens of their own (GLM's are) are
  held as those tokens.
- Granite (3.x): ``<|tool_call|>[{"name": "NAME", "arguments": {...}}, ...]``, every call of the
  turn in one JSON list, no closing tag.

``tool_grammars`` returns two grammars: a call from after its ``<tool_call>`` token (the model
opened it), and the rest of the answer when the prompt's pre-fill already opened a call
(``tool_choice`` required: after ``{"name": "``, ``<function=`` or GLM's ``<tool_call>``, then with parallel calls
allowed any number of further whole calls; named: from where the arguments start, one call).
A forced answer is calls only: the request ends when its grammar does (or at EOS). A call
follows its tool's schema when the tool is ``strict`` or the call is forced; a tool that is
neither gets any JSON object (any parameters) but still one of the tools' names.
"""
from __future__ import annotations

import json

from ..errors import InvalidRequest
from ..executor import guide
from .errors import ApiError
from .parser import TOOL_CLOSE, TOOL_OPEN

_COMPACT = {"whitespace_flexible": False}
_SPACED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lit(text: str) -> str:
    return json.dumps(text)     # a lark string literal


def _json(schema: dict | None, style: dict, default_type: str | None = None) -> str:
    body = dict(schema or {})
    if default_type:
        body.setdefault("type", default_type)
    return f"%json {json.dumps({**body, 'x-guidance': style})}"


class _Rules:
    """Lark rules under fresh names."""

    def __init__(self):
        self.lines: list[str] = []

    def add(self, body: str, attrs: str = "") -> str:
        name = f"r{len(self.lines)}"
        self.lines.append(f"{name}{attrs}: {body}")
        return name


def _xml_value(rules: _Rules, schema) -> str:
    """A parameter's value and its closing tag."""
    schema = schema if isinstance(schema, dict) else {}
    enum = schema.get("enum")
    tail = _lit("\n</parameter>\n")
    if enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(_lit(v) for v in enum) + ") " + tail
    if schema.get("type", "string") == "string" and "enum" not in schema:
        text = rules.add("/(?s:.*)/", '[stop="\\n</parameter>"]')
        return f'{text} "\\n"'
    return f"{_json(schema, _COMPACT)} {tail}"


def _xml_parameters(rules: _Rules, schema: dict | None, strict: bool) -> str:
    schema = schema if isinstance(schema, dict) else {}
    props = schema.get("properties") if strict else None
    if not isinstance(props, dict):          # any parameters
        text = rules.add("/(?s:.*)/", '[stop="\\n</parameter>"]')
        return rules.add(f'("<parameter=" /[^>\\n]+/ ">\\n" {text} "\\n")*')
    required = set(schema.get("required") or ())
    parts = []
    for key, sub in props.items():
        tag = f"<parameter={key}>\n"
        p = rules.add(f"{_lit(tag)} {_xml_value(rules, sub)}")
        parts.append(p if key in required else f"{p}?")
    return " ".join(parts)


def _glm_value(rules: _Rules, schema, tag) -> str:
    """A GLM parameter's value and its closing tag."""
    schema = schema if isinstance(schema, dict) else {}
    enum, close = schema.get("enum"), tag("</arg_value>")
    if enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(_lit(v) for v in enum) + f") {close}"
    if schema.get("type", "string") == "string" and "enum" not in schema:
        return _glm_text(rules, close)
    return f"{_json(schema, _SPACED)} {close}"


def _glm_text(rules: _Rules, close: str) -> str:
    """Any text, then the closing tag: a token of its own ends the text by itself; a tag that is
    text ends it lazily."""
    if close.startswith("<["):
        return f"/(?s:.*)/ {close}"
    return rules.add("/(?s:.*)/", f"[stop={close}]")


def _glm_parameters(rules: _Rules, schema: dict | None, strict: bool, tag) -> str:
    schema = schema if isinstance(schema, dict) else {}
    props = schema.get("properties") if strict else None
    key, value = f'{tag("<arg_key>")}', f'{tag("</arg_key>")} /\\n?/ {tag("<arg_value>")}'
    if not isinstance(props, dict):          # any parameters
        return rules.add(f'({key} /[^<\\n]+/ {value} {_glm_text(rules, tag("</arg_value>"))} /\\n?/)*')
    required = set(schema.get("required") or ())
    parts = []
    for name, sub in props.items():
        p = rules.add(f"{key} {_lit(name)} {value} {_glm_value(rules, sub, tag)} /\\n?/")
        parts.append(p if name in required else f"{p}?")
    return " ".join(parts)


def tool_grammars(tokenizer, prompt) -> tuple[str | None, str | None]:
    """(a call after its opening token, the rest of the call the prompt opened), or None for
    each where nothing needs holding. Raises ApiError(400) when a strict tool's schema cannot be
    compiled; a forced call to such a schema is left to the pre-fill alone."""
    schemas = prompt.schemas or {}
    if not schemas or not (prompt.forced or prompt.strict):
        return None, None
    if prompt.style == "minimax":     # no grammar for its blocks of calls yet: forced calls pre-filled only
        if prompt.strict:
            raise ApiError(400, "tools: 'strict' tool calls are not available for this model's tool-call format "
                                "(MiniMax-M2's <minimax:tool_call>); send the tools without 'strict'", param="tools")
        return None, None

    def tag(text: str) -> str:                 # a tag that is a token of its own is held as that token
        at = tokenizer.token_to_id(text)
        return f"<[{at}]>" if at is not None else _lit(text)

    if prompt.style == "granite":
        return _granite(schemas, prompt)
    close = tag(TOOL_CLOSE)
    xml, glm = prompt.style == "xml", prompt.style == "glm"
    rules = _Rules()
    bodies, heads = {}, {}
    for name, schema in schemas.items():
        strict = prompt.forced is not None or name in prompt.strict
        if glm:
            bodies[name] = f'/\\n?/ {_glm_parameters(rules, schema, strict, tag)} {close}'
            heads[name] = name
        elif xml:
            bodies[name] = f'{_xml_parameters(rules, schema, strict)} "</function>" /\\n?/ {close}'
            heads[name] = f"{name}>\n"
        else:
            args = _json(schema if strict else None, _SPACED, "object")
            bodies[name] = f'{args} "}}" /\\n?/ {close}'
            heads[name] = json.dumps(name) + ', "arguments": '
    # what follows a call's opening token before its name
    opened = "" if glm else '/\\n?/ "<function=" ' if xml else '/\\n?/ "{\\"name\\": " '
    # a required call's pre-fill ends after "<function=" (XML), "<tool_call>" (GLM) or inside
    # the name's quotes (JSON)
    prefilled = {n: (h if xml or glm else h[1:]) for n, h in heads.items()}

    def alts(names: dict) -> str:
        return "(" + " | ".join(f"{_lit(head)} {bodies[name]}" for name, head in names.items()) + ")"

    def grammar(start: str) -> str:
        return "\n".join([f"start: {start}", *rules.lines])

    after_open = grammar(opened + alts(heads))
    open_id = tokenizer.token_to_id(TOOL_OPEN)
    if prompt.forced in schemas:        # named: the pre-fill ends where the arguments start
        rest = grammar(bodies[prompt.forced])
    elif prompt.forced:
        # required: the pre-filled call, then (parallel calls allowed) more whole calls, then EOS;
        # a forced answer holds nothing but calls
        more = (f" (/\\n?/ <[{open_id}]> {opened}{alts(heads)})*"
                if prompt.parallel and open_id is not None else "")
        rest = grammar(alts(prefilled) + more)
    else:
        rest = None
    return _both(after_open, rest, prompt)


def _granite(schemas: dict, prompt) -> tuple[str | None, str | None]:
    """Granite: after ``<|tool_call|>`` a JSON list of calls, ``[{"name": "NAME", "arguments":
    {...}}, ...]`` (one call when parallel calls are off); the pre-fill of a required call ends
    inside the first name's quotes, a named one's where its arguments start."""
    bodies = {name: _json(schema if prompt.forced is not None or name in prompt.strict else None, _SPACED, "object")
              + ' "}"' for name, schema in schemas.items()}
    heads = {name: json.dumps(name) + ', "arguments": ' for name in schemas}
    call = '"{\\"name\\": " (' + " | ".join(f"{_lit(heads[n])} {bodies[n]}" for n in schemas) + ")"
    more = ' ("," /[ \\n]?/ ' + call + ")*" if prompt.parallel else ""
    after_open = f'start: /[ \\n]?/ "[" {call}{more} "]"'
    if prompt.forced in schemas:
        rest = f'start: {bodies[prompt.forced]} "]"'
    elif prompt.forced:
        rest = "start: (" + " | ".join(f"{_lit(heads[n][1:])} {bodies[n]}" for n in schemas) + f'){more} "]"'
    else:
        rest = None
    return _both(after_open, rest, prompt)


def _both(after_open: str, rest: str | None, prompt) -> tuple[str | None, str | None]:
    try:
        return (_compiled(after_open), None if rest is None else _compiled(rest))
    except ApiError:
        if prompt.strict:
            raise       # strictness was asked for: say why it cannot be had
        return None, None   # a forced call to a schema the grammar engine cannot use: pre-fill only


def _compiled(source: str) -> str:
    try:
        return guide.lark(source, "tools")
    except InvalidRequest as exc:
        raise ApiError(400, f"tools: {exc}", param="tools") from None


__all__ = ["tool_grammars"]
