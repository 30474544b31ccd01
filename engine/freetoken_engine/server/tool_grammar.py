"""Grammars that hold tool calls to their tools' schemas, in the chat template's own format.

The formats (``prompt.style``), among them:

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
- MiniMax-M2: ``<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE
  </parameter>\\n...</invoke>\\n...</minimax:tool_call>``, several calls to a block; values as
  in the XML format, a string any text up to ``</parameter>``.
- Python calls (LFM2): ``<|tool_call_start|>[NAME(KEY=VALUE, ...), ...]<|tool_call_end|>``, values
  JSON for their schema.
- Granite (3.x): ``<|tool_call|>[{"name": "NAME", "arguments": {...}}, ...]``, every call of the
  turn in one JSON list, no closing tag; Hunyuan's the same list between ``<tool_calls>`` tags.
- Harmony (gpt-oss): messages on channels, a call ``commentary to=functions.NAME <|constrain|>json
  <|message|>{...}<|call|>`` (tool_grammar_harmony.py).
- DeepSeek (V3.1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
  <｜tool▁calls▁end｜>``; V3 and R1 (``deepseek_fenced``) write ``function<｜tool▁sep｜>NAME``, then the
  arguments in a fenced JSON block.

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
from dataclasses import dataclass

from .grammar_parts import COMPACT, SPACED, Rules, both, held, json_arg, lit
from .parser import COHERE_CLOSE, HUNYUAN_CLOSE, INVOKE, MINIMAX_CLOSE, PYTHONIC_CLOSE, TOOL_CLOSE, TOOL_OPEN
from .parser_deepseek import (CALL_BEGIN, CALL_END, CALLS_END, FENCE, FENCE_END, KIMI_CALL_BEGIN, KIMI_CALL_END,
                              KIMI_CALLS_END, KIMI_PREFIX, KIMI_SEP, MISTRAL_ARGS, MISTRAL_CALLS, SEP, SOLAR_ARGS,
                              SOLAR_BEGIN, SOLAR_CALL_END, SOLAR_NAME)
from .tool_grammar_harmony import harmony


@dataclass(frozen=True)
class _Params:
    """An XML-like parameter: ``head`` (``{key}`` its name) and the value up to ``close``, then
    ``after``; ``any_key`` a name in the any-parameters form."""

    head: str
    close: str
    after: str
    any_key: str


_XML = _Params("<parameter={key}>\n", "\n</parameter>", '"\\n"', '/[^>\\n]+/ ">\\n"')
_MINIMAX = _Params('<parameter name="{key}">', "</parameter>", "/\\n?/", '/[^"\\n]+/ "\\">"')


def _xml_value(rules: Rules, schema, form: _Params) -> str:
    """A parameter's value and its closing tag."""
    schema = schema if isinstance(schema, dict) else {}
    enum = schema.get("enum")
    tail = f"{lit(form.close)} {form.after}"
    if enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(lit(v) for v in enum) + ") " + tail
    if schema.get("type", "string") == "string" and "enum" not in schema:
        return f"{_text(rules, form)} {form.after}"
    return f"{json_arg(schema, COMPACT)} {tail}"


def _text(rules: Rules, form: _Params) -> str:
    """Any text, ended by (and taking) the closing tag."""
    return rules.add("/(?s:.*)/", f"[stop={lit(form.close)}]")


def _xml_parameters(rules: Rules, schema: dict | None, strict: bool, form: _Params = _XML) -> str:
    schema = schema if isinstance(schema, dict) else {}
    props = schema.get("properties") if strict else None
    if not isinstance(props, dict):          # any parameters
        opening = lit(form.head[:form.head.index("{key}")])
        return rules.add(f"({opening} {form.any_key} {_text(rules, form)} {form.after})*")
    required = set(schema.get("required") or ())
    parts = []
    for key, sub in props.items():
        p = rules.add(f"{lit(form.head.format(key=key))} {_xml_value(rules, sub, form)}")
        parts.append(p if key in required else f"{p}?")
    return " ".join(parts)


def _glm_value(rules: Rules, schema, tag) -> str:
    """A GLM parameter's value and its closing tag."""
    schema = schema if isinstance(schema, dict) else {}
    enum, close = schema.get("enum"), tag("</arg_value>")
    if enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(lit(v) for v in enum) + f") {close}"
    if schema.get("type", "string") == "string" and "enum" not in schema:
        return _glm_text(rules, close)
    return f"{json_arg(schema, SPACED)} {close}"


def _glm_text(rules: Rules, close: str) -> str:
    """Any text, then the closing tag: a token of its own ends the text by itself; a tag that is
    text ends it lazily."""
    if close.startswith("<["):
        return f"/(?s:.*)/ {close}"
    return rules.add("/(?s:.*)/", f"[stop={close}]")


def _glm_parameters(rules: Rules, schema: dict | None, strict: bool, tag) -> str:
    schema = schema if isinstance(schema, dict) else {}
    props = schema.get("properties") if strict else None
    key, value = f'{tag("<arg_key>")}', f'{tag("</arg_key>")} /\\n?/ {tag("<arg_value>")}'
    if not isinstance(props, dict):          # any parameters
        return rules.add(f'({key} /[^<\\n]+/ {value} {_glm_text(rules, tag("</arg_value>"))} /\\n?/)*')
    required = set(schema.get("required") or ())
    parts = []
    for name, sub in props.items():
        p = rules.add(f"{key} {lit(name)} {value} {_glm_value(rules, sub, tag)} /\\n?/")
        parts.append(p if name in required else f"{p}?")
    return " ".join(parts)


def tool_grammars(tokenizer, prompt) -> tuple[str | None, str | None]:
    """(a call after its opening token, the rest of the call the prompt opened), or None for
    each where nothing needs holding. Raises ApiError(400) when a strict tool's schema cannot be
    compiled; a forced call to such a schema is left to the pre-fill alone."""
    schemas = prompt.schemas or {}
    if not schemas or not (prompt.forced or prompt.strict):
        return None, None

    def tag(text: str) -> str:                 # a tag that is a token of its own is held as that token
        at = tokenizer.token_to_id(text)
        return f"<[{at}]>" if at is not None else lit(text)

    if prompt.style in ("granite", "hunyuan", "cohere"):
        close = {"hunyuan": f" {tag(HUNYUAN_CLOSE)}", "cohere": f" {tag(COHERE_CLOSE)}"}.get(prompt.style, "")
        return _granite(schemas, prompt, close, cohere=prompt.style == "cohere")
    if prompt.style == "minimax":
        return _minimax(schemas, prompt, tag)
    if prompt.style == "pythonic":
        return _pythonic(schemas, prompt, tag)
    if prompt.style in ("deepseek", "deepseek_fenced", "kimi", "solar"):
        return _deepseek(schemas, prompt, tag, prompt.style)
    if prompt.style == "harmony":
        return harmony(schemas, prompt, tag)
    if prompt.style == "mistral":
        return _mistral(schemas, prompt, tag)
    close = tag(TOOL_CLOSE)
    xml, glm = prompt.style == "xml", prompt.style == "glm"
    rules = Rules()
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
            args = json_arg(schema if strict else None, SPACED, "object")
            bodies[name] = f'{args} "}}" /\\n?/ {close}'
            heads[name] = json.dumps(name) + ', "arguments": '
    # what follows a call's opening token before its name
    opened = "" if glm else '/\\n?/ "<function=" ' if xml else '/\\n?/ "{\\"name\\": " '
    # a required call's pre-fill ends after "<function=" (XML), "<tool_call>" (GLM) or inside
    # the name's quotes (JSON)
    prefilled = {n: (h if xml or glm else h[1:]) for n, h in heads.items()}

    def alts(names: dict) -> str:
        return "(" + " | ".join(f"{lit(head)} {bodies[name]}" for name, head in names.items()) + ")"

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
    return both(after_open, rest, prompt)


def _granite(schemas: dict, prompt, close: str = "", cohere: bool = False) -> tuple[str | None, str | None]:
    """Granite: after ``<|tool_call|>`` a JSON list of calls, ``[{"name": "NAME", "arguments":
    {...}}, ...]`` (one call when parallel calls are off); the pre-fill of a required call ends
    inside the first name's quotes, a named one's where its arguments start. Hunyuan: the same
    list after ``<tool_calls>``, then ``close`` (``</tool_calls>``). Cohere (``cohere``): after
    ``<|START_ACTION|>``, ``[{"tool_call_id": "N", "tool_name": "NAME", "parameters": {...}}]``,
    then ``<|END_ACTION|>``."""
    bodies = {name: json_arg(schema if prompt.forced is not None or name in prompt.strict else None, SPACED, "object")
              + ' "}"' for name, schema in schemas.items()}
    key = ', "parameters": ' if cohere else ', "arguments": '
    heads = {name: json.dumps(name) + key for name in schemas}
    # Cohere writes its list one call a line, indented: any whitespace around its calls
    ws = "(/[ \\n]+/)? " if cohere else ""
    start = '"{\\"tool_call_id\\": \\"" /[0-9]+/ "\\", \\"tool_name\\": "' if cohere else '"{\\"name\\": "'
    call = ws + start + ' (' + " | ".join(f"{lit(heads[n])} {bodies[n]}" for n in schemas) + ")"
    more = ' ("," /[ \\n]?/ ' + call + ")*" if prompt.parallel else ""
    end = f'{ws}"]"{close}'
    return held(Rules(), prompt, f'/[ \\n]?/ "[" {call}{more} {end}', lambda name: f'{bodies[name]} {end}',
                 "(" + " | ".join(f"{lit(heads[n][1:])} {bodies[n]}" for n in schemas) + f'){more} {end}')


def _minimax(schemas: dict, prompt, tag) -> tuple[str | None, str | None]:
    """MiniMax-M2: after ``<minimax:tool_call>`` one or more calls (one without parallel calls),
    each ``<invoke name="NAME">\n`` then its parameters, ``<parameter name="KEY">VALUE
    </parameter>\n``, then ``</invoke>\n``, then the block's close. The pre-fill of a required
    call ends inside the first name's quotes, a named one's after its ``<invoke>`` line."""
    rules = Rules()
    params = {name: _xml_parameters(rules, schema, prompt.forced is not None or name in prompt.strict, _MINIMAX)
              for name, schema in schemas.items()}
    heads = {name: f'{name}">\n' for name in schemas}
    end_call, close = '"</invoke>" /\\n?/', f"{tag(MINIMAX_CLOSE)}"
    named = "(" + " | ".join(f"{lit(heads[n])} {params[n]} {end_call}" for n in schemas) + ")"
    call = f'/\\n?/ {lit(INVOKE)} {named}'
    more = f" ({call})*" if prompt.parallel else ""
    return held(rules, prompt, f"{call}{more} /\\n?/ {close}", lambda name: f"{params[name]} {end_call} {close}",
                 f"{named}{more} /\\n?/ {close}")


def _pythonic(schemas: dict, prompt, tag) -> tuple[str | None, str | None]:
    """LFM2: after ``<|tool_call_start|>`` a Python list of calls, ``[NAME(KEY=VALUE, ...), ...]``
    (one call without parallel calls), then ``<|tool_call_end|>``; a value is JSON for its schema
    (which Python reads, JSON's true/false/null as the parser reads them), the schema's
    properties in its order, the required ones always. The pre-fill of a required call ends
    after the ``[``, a named one's after its ``(``."""
    rules = Rules()
    params = {name: _keywords(rules, schema if prompt.forced is not None or name in prompt.strict else None)
              for name, schema in schemas.items()}
    call = "(" + " | ".join(f'{lit(n + "(")} {params[n]} ")"' for n in schemas) + ")"
    call = rules.add(call)
    more = f' ("," /[ ]?/ {call})*' if prompt.parallel else ""
    end = f'"]" {tag(PYTHONIC_CLOSE)}'
    return held(rules, prompt, f'"[" {call}{more} {end}', lambda name: f'{params[name]} ")" {end}',
                 f"{call}{more} {end}")


def _deepseek(schemas: dict, prompt, tag, style: str) -> tuple[str | None, str | None]:
    """DeepSeek: after ``<｜tool▁calls▁begin｜>`` one or more calls (one without parallel calls),
    each ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`` (``deepseek_fenced``:
    ``function<｜tool▁sep｜>NAME``, a newline, the arguments between ```` ```json ```` lines), then
    the block's close. Kimi-K2 (``kimi``): the same in its tokens, the name written as the call's
    id ``functions.NAME:INDEX``. Solar Open (``solar``): after ``<|tool_calls|>`` each call is
    ``<|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>ARGS<|tool_call:end|>``, and the
    calls end with the generation (``<|calls|>`` is an end token). The pre-fill of a required call
    ends where the first name is written, a named one's where its arguments start."""
    args = {name: json_arg(schema if prompt.forced is not None or name in prompt.strict else None, SPACED, "object")
            for name, schema in schemas.items()}
    if style == "deepseek_fenced":
        head, body = f'"function" {tag(SEP)} ', lambda n: f'{lit(n)} {lit(chr(10) + FENCE + chr(10))} '
        end = f'{lit(chr(10) + FENCE_END)} {tag(CALL_END)}'
        begin, calls_end = CALL_BEGIN, CALLS_END
    elif style == "kimi":
        head, body = f"{lit(KIMI_PREFIX)} ", lambda n: f'{lit(n + ":")} /[0-9]+/ {tag(KIMI_SEP)} '
        end, begin, calls_end = tag(KIMI_CALL_END), KIMI_CALL_BEGIN, KIMI_CALLS_END
    elif style == "solar":
        head, body = f"/[A-Za-z0-9]{{1,32}}/ {tag(SOLAR_NAME)} ", lambda n: f"{lit(n)} {tag(SOLAR_ARGS)} "
        end, begin, calls_end = tag(SOLAR_CALL_END), SOLAR_BEGIN, None
    else:
        head, body, end = "", lambda n: f"{lit(n)} {tag(SEP)} ", tag(CALL_END)
        begin, calls_end = CALL_BEGIN, CALLS_END
    named = "(" + " | ".join(f"{body(n)}{args[n]} {end}" for n in schemas) + ")"
    call = f"/\\n?/ {tag(begin)} {head}{named}"
    more = f" ({call})*" if prompt.parallel else ""
    close = f"/\\n?/ {tag(calls_end)}" if calls_end else ""
    return held(Rules(), prompt, f"{call}{more} {close}", lambda name: f"{args[name]} {end} {close}",
                 f"{named}{more} {close}")


def _mistral(schemas: dict, prompt, tag) -> tuple[str | None, str | None]:
    """Mistral: after ``[TOOL_CALLS]``, ``NAME[ARGS]{...}``, further calls each after another
    ``[TOOL_CALLS]`` (none without parallel calls); no closing tag: the generation ends. The
    pre-fill of a required call ends after the tag, a named one's after ``[ARGS]``."""
    args = {name: json_arg(schema if prompt.forced is not None or name in prompt.strict else None, SPACED, "object")
            for name, schema in schemas.items()}
    call = "(" + " | ".join(f"{lit(n)} {tag(MISTRAL_ARGS)} {args[n]}" for n in schemas) + ")"
    more = f" ({tag(MISTRAL_CALLS)} {call})*" if prompt.parallel else ""
    return held(Rules(), prompt, f"{call}{more}", lambda name: f"{args[name]}{more}", f"{call}{more}")


def _keywords(rules: Rules, schema: dict | None) -> str:
    """A call's keyword arguments: any (None), else the schema's properties in its order, the
    required ones always, separated by ", "."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        pair = f'/[A-Za-z_][A-Za-z0-9_]*/ "=" {json_arg(None, SPACED)}'
        return rules.add(f'({pair} ("," /[ ]?/ {pair})*)?')
    required = set(schema.get("required") or ())
    keys = list(props)
    memo: dict[tuple[int, bool], str] = {}

    def after(i: int, first: bool) -> str:
        """The properties from the i-th on; ``first``: none written before them."""
        if i == len(keys):
            return ""
        if (i, first) not in memo:
            sep = "" if first else lit(", ") + " "
            one = f'{sep}{lit(keys[i] + "=")} {json_arg(props[keys[i]], SPACED)}'
            rest = after(i + 1, False)
            body = f"{one} {rest}".strip()
            if keys[i] not in required:
                skip = after(i + 1, first)
                body = f"({body})" + (f" | {skip}" if skip else "?")
            memo[i, first] = rules.add(body) if body else ""
        return memo[i, first]
    return after(0, True)


__all__ = ["tool_grammars"]
