"""Tool calls held to their schemas in both chat-template formats: Hermes JSON (Qwen3) and XML
(Qwen3.5/3.6, Qwen3-Coder). Hand-written calls are checked token by token against the masks
(a right call is allowed throughout, a wrong one is cut where it goes wrong), and a random model
forced to call (``tool_choice`` required or named) through a live server always produces calls
that parse and satisfy the schema, in the XML format too."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from live import serving
from test_tool_calls_xml import TEMPLATE as XML_TEMPLATE
from tiny_models import with_template

from freetoken_engine.executor.guide import Guide, GuideSpec
from freetoken_engine.server.prompt import Prompt
from freetoken_engine.server.tool_grammar import tool_grammars

WEATHER = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
           "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "note": {"type": "string"}}}
SEARCH = {"type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
MSGS = [{"role": "user", "content": "Weather?"}]


def prompt(style: str, forced: str | None = None, strict=frozenset(), parallel: bool = True) -> Prompt:
    return Prompt(ids=[1], in_reasoning=False, prefill="x" if forced else "", tools=True, style=style,
                  schemas=SCHEMAS, strict=frozenset(strict), forced=forced, parallel=parallel)


def walk(tokenizer, vocab: int, grammar: str, text: str, close: int | None,
         guide: Guide | None = None) -> tuple[int, bool]:
    """Feed ``text`` then the closing token (None: none, a format without one) under the masks:
    (tokens allowed, grammar complete: the request ended there, or the grammar may end there)."""
    g = guide or Guide(GuideSpec(None, in_tool=grammar), tokenizer, vocab)
    ids = tokenizer.encode(text, add_special_tokens=False) + ([close] if close is not None else [])
    for n, t in enumerate(ids):
        if not torch.isfinite(g.constrain(torch.zeros(vocab))[t]):
            return n, False
        if g.advance(t):
            return n + 1, n + 1 == len(ids)
    return len(ids), g.tool is not None and g.tool.is_accepting()


def allowed(g: Guide, vocab: int) -> set[int]:
    return set(torch.isfinite(g.constrain(torch.zeros(vocab))).nonzero().flatten().tolist())


@pytest.fixture(scope="module")
def tok(tiny_service):
    return tiny_service.tokenizer, tiny_service.vocab_size, tiny_service.tokenizer.token_to_id("</tool_call>")


@pytest.mark.parametrize("style, text", [
    ("json", '\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3, "note": "any </parameter> text"}}\n'),
    ("json", '\n{"name": "search", "arguments": {"query": "llguidance"}}\n'),
    ("xml", "\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "<parameter=note>\nmulti\nline </parameter> text\n</parameter>\n</function>\n"),
    ("xml", "\n<function=search>\n<parameter=query>\nwhat is <b>bold</b>?\n</parameter>\n</function>\n"),
])
def test_right_calls_are_allowed_token_by_token(tok, style, text):
    tokenizer, vocab, close = tok
    after_open, _ = tool_grammars(tokenizer, prompt(style, strict={"get_weather", "search"}))
    n, complete = walk(tokenizer, vocab, after_open, text, close)
    assert complete and n == len(tokenizer.encode(text, add_special_tokens=False)) + 1


@pytest.mark.parametrize("style, text, wrong", [
    ("json", '\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n', "Oslo"),
    ("json", '\n{"name": "delete_all", "arguments": {}}\n', "delete"),
    ("xml", "\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n", "days"),   # city first
    ("xml", "\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n9\n</parameter>\n"
            "</function>\n", "9"),
    ("xml", "\n<function=search>\n</function>\n", "</function>"),                                         # query required
])
def test_wrong_calls_are_cut_where_they_go_wrong(tok, style, text, wrong):
    tokenizer, vocab, close = tok
    after_open, _ = tool_grammars(tokenizer, prompt(style, strict={"get_weather", "search"}))
    n, complete = walk(tokenizer, vocab, after_open, text, close)
    allowed = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:n])
    at = text.index(wrong)
    assert not complete and at - 4 <= len(allowed) < at + len(wrong)   # right up to the wrong part


def test_forced_rests_start_where_the_prefill_ends(tok):
    tokenizer, vocab, close = tok
    _, named = tool_grammars(tokenizer, prompt("xml", forced="get_weather"))
    assert walk(tokenizer, vocab, named, "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n1\n"
                                          "</parameter>\n</function>\n", close)[1]
    _, required = tool_grammars(tokenizer, prompt("xml", forced="required"))
    assert walk(tokenizer, vocab, required, "search>\n<parameter=query>\nx\n</parameter>\n</function>\n", close)[1]
    _, required = tool_grammars(tokenizer, prompt("json", forced="required"))
    assert walk(tokenizer, vocab, required, 'search", "arguments": {"query": "x"}}\n', close)[1]
    assert tool_grammars(tokenizer, prompt("json")) == (None, None)      # auto, nothing strict: free


@pytest.mark.parametrize("style, first, second", [
    ("json", 'search", "arguments": {"query": "x"}}\n', '\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n'),
    ("xml", "search>\n<parameter=query>\nx\n</parameter>\n</function>\n",
            "\n<function=search>\n<parameter=query>\ny\n</parameter>\n</function>\n"),
])
def test_a_forced_answer_is_calls_then_the_end(tok, style, first, second):
    """tool_choice required: after the pre-filled call only another whole call (parallel calls)
    or EOS may follow, never text; without parallel calls the request ends at the first call's
    close. A named call ends the request at its close."""
    tokenizer, vocab, close = tok
    open_, eos = tokenizer.token_to_id("<tool_call>"), set(tokenizer.eos_token_ids)
    _, required = tool_grammars(tokenizer, prompt(style, forced="required"))
    g = Guide(GuideSpec(None, in_tool=required), tokenizer, vocab)
    assert walk(tokenizer, vocab, required, first, close, g) == (len(tokenizer.encode(first, add_special_tokens=False)) + 1, True)
    after = allowed(g, vocab)
    assert open_ in after and eos <= after
    assert not after & set(tokenizer.encode("Hello", add_special_tokens=False))      # no text after the calls
    assert not g.advance(open_)
    assert walk(tokenizer, vocab, None, second, close, g)[1]                       # a second whole call
    assert eos <= allowed(g, vocab)

    _, single = tool_grammars(tokenizer, prompt(style, forced="required", parallel=False))
    n, ended = walk(tokenizer, vocab, single, first, close)
    assert ended and n == len(tokenizer.encode(first, add_special_tokens=False)) + 1

    _, named = tool_grammars(tokenizer, prompt("json", forced="search"))
    assert walk(tokenizer, vocab, named, '{"query": "x"}}\n', close) == (
        len(tokenizer.encode('{"query": "x"}}\n', add_special_tokens=False)) + 1, True)


@pytest.fixture(scope="module")
def xml_live(tiny_checkpoint, tmp_path_factory):
    # the tiny tokenizer spends 460 tokens on this prompt: a longer context leaves room for a call
    folder = with_template(tiny_checkpoint("qwen3_moe", max_position_embeddings=2048),
                           tmp_path_factory.mktemp("xml-engine") / "m", XML_TEMPLATE)
    with serving(folder, max_context=1024) as srv:
        yield srv


ENUMS = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
         "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}


@pytest.mark.parametrize("seed", range(3))
def test_a_random_model_forced_to_call_in_xml_writes_valid_calls(xml_live, seed):
    client = xml_live.openai()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": ENUMS}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}]
    schemas = {"get_weather": ENUMS, "get_time": tools[1]["function"]["parameters"]}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = client.chat.completions.create(model=xml_live.model, messages=MSGS, tools=tools, tool_choice=choice,
                                           max_tokens=200, temperature=1.0, seed=seed)
        calls = r.choices[0].message.tool_calls     # (then the random model rambles to max_tokens)
        assert calls, r.choices[0]
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
        if isinstance(choice, dict):
            assert calls[0].function.name == "get_time"
