"""gpt-oss's harmony format in the tool-call grammars (``tool_grammar.tool_grammars``): messages on
channels, each call a ``commentary`` message to ``functions.NAME`` (server/parser_harmony.py)."""
from __future__ import annotations

from .grammar_parts import SPACED, Rules, both, compiled, held, json_arg, lit
from .parser_harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START


def harmony(schemas: dict, prompt, tag) -> tuple[str | None, str | None]:
    """gpt-oss (harmony). Forced: the rest of the call after its pre-fill, ``NAME <|constrain|>json
    <|message|>ARGS<|call|>`` from the name on (required) or ARGS<|call|> (named; ``<|call|>`` ends
    the turn). Strict tools on ``auto``: ``<|channel|>`` opens every message (reasoning and
    answers too), so the grammar after it (or after ``<|start|>``, which opens the messages after
    the first; the escapes, ``harmony_escapes``) holds a whole message: reasoning (``analysis``),
    an answer (``final``) or a preamble (``commentary``), free text to their end tag, or a call,
    ``commentary to=functions.NAME [<|constrain|>]json<|message|>ARGS<|call|>``, with the recipient
    after the channel or after the role (``assistant to=functions.NAME<|channel|>commentary
    json``), NAME one of the tools and ARGS valid for its schema where it is strict."""
    args = {name: json_arg(schema if prompt.forced or name in prompt.strict else None, SPACED, "object")
            for name, schema in schemas.items()}
    if prompt.forced:
        head = f" {tag(CONSTRAIN)} {lit('json')} {tag(MESSAGE)} "
        required = "(" + " | ".join(f"{lit(n + ' ')}{head}{args[n]} {tag(CALL)}" for n in schemas) + ")"
        return held(Rules(), prompt, None, lambda name: f"{args[name]} {tag(CALL)}", required)
    rules = Rules()
    body = {n: f"{tag(MESSAGE)} {args[n]} {tag(CALL)}" for n in schemas}
    # the recipient after the channel: "commentary to=functions.NAME <|constrain|>json<|message|>"
    after_channel = rules.add(" | ".join(
        f'{lit(n)} " "? ({tag(CONSTRAIN)} {lit("json")} | {lit("json")})? {body[n]}' for n in schemas))
    # after the role: "assistant to=functions.NAME<|channel|>commentary json<|message|>"
    after_role = rules.add(" | ".join(
        f'{lit(n)} {tag(CHANNEL)} "commentary" (" " {tag(CONSTRAIN)}? {lit("json")})? {body[n]}'
        for n in schemas))
    text = rules.add("/(.|\\n)*/")
    message = rules.add(
        f'"analysis" {tag(MESSAGE)} {text} {tag(END)}'
        f' | "final" {tag(MESSAGE)} {text} ({tag(RETURN)} | {tag(END)})'
        f' | "commentary" {tag(MESSAGE)} {text} {tag(END)}'
        f' | "commentary to=functions." {after_channel}')
    opened = f'"assistant" (" to=functions." {after_role} | {tag(CHANNEL)} {message}) | {message}'
    return both(compiled("\n".join([f"start: {opened}", *rules.lines])), None, prompt)


def harmony_escapes(tokenizer) -> tuple[int, ...]:
    """The tokens after which harmony's grammar for calls the model opens applies (``_harmony``):
    ``<|start|>`` and ``<|channel|>``, those the tokenizer has as tokens of their own."""
    return tuple(t for t in (tokenizer.token_to_id(START), tokenizer.token_to_id(CHANNEL))
                 if t is not None)


__all__ = ["harmony", "harmony_escapes"]
