"""Tool calls in Granite 3.x's format: ``<|tool_call|>`` (a special token, which decoding would
leave out) and then every call of the turn as one JSON list, ``[{"name": ..., "arguments":
{...}}, ...]``, with no closing tag. Parsed on any split, through the official OpenAI and
Anthropic clients (arguments streamed as they come), the history rendered back by the template,
named and required calls pre-filled, and held to their schemas by the grammar: hand-written
calls token by token, and a random model forced to call through a live engine. The template is
this test's own, in Granite's layout; scripted answers come from a ``ScriptedService``."""
from __future__ import annotations

import functools
import json

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st
from live import served_folder  # noqa: F401  (the live fixture)
from scripted import chat_calls, check_forced_calls, recording_server, script, second_turn, streamed, tool_uses
from test_tool_calls_glm import calls
from test_tool_grammar import walk as grammar_walk
from tiny_models import mark_special, with_template

from freetoken_engine.models.tokenizer import Tokenizer
from freetoken_engine.server.parser import (Content, OutputParser, Reasoning, ToolArgs, ToolEnd, ToolStart,
                                           format_tags, output_parser)
from freetoken_engine.server.prompt import Prompt, tool_style
from freetoken_engine.server.tool_grammar import tool_grammars

TAG = "<|tool_call|>"
TEMPLATE = (
    "{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>[{% for tool in tools %}{{ tool | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|start_of_role|>{{ m.role }}<|end_of_role|>"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{ m.content or '' }}<|tool_call|>["
    "{%- for tc in m.tool_calls %}{% set f = tc.function if tc.function is defined else tc %}"
    "{\"name\": {{ f.name | tojson }}, \"arguments\": {{ f.arguments | tojson }}}{% if not loop.last %}, {% endif %}"
    "{%- endfor %}]{%- else %}{{ m.content if m.content is string else '' }}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}")
LIST = ('[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"arguments": {"query": "rain [gear]"}, "name": "search"}]')
ANSWER = "<think>The user wants the forecast.</think>\n\nChecking." + TAG + LIST
WANT = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "rain [gear]"})]
SCHEMAS = {"get_weather": {"type": "object", "required": ["city", "days"], "additionalProperties": False,
                           "properties": {"city": {"enum": ["Paris", "Rome"]},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}},
           "search": {"type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
A_TOOLS = [{"name": n, "description": n, "input_schema": s} for n, s in SCHEMAS.items()]
MSGS = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


def events(text: str, cuts: list[int], style: str = "granite", in_reasoning: bool = False, tools: bool = True) -> list:
    """The parser's events for ``text`` fed in the pieces ``cuts`` make."""
    p = output_parser(tools=tools, style=style, schemas=SCHEMAS, in_reasoning=in_reasoning)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [e for piece in pieces for e in p.feed(piece)] + p.finish()


#: (tool, its arguments, the first text the grammar refuses: None when the call is allowed) of the
#: formats whose calls are a name and a JSON object
HELD = [
    ("get_weather", '{"city": "Rome", "days": 3}', None),
    ("get_weather", '{"city": "Oslo", "days": 3}', "Oslo"),
    ("get_weather", '{"city": "Rome", "days": 9}', "9"),
    ("delete_all", "{}", "delete"),
    ("search", "{}", "}"),                                              # query required
]


def shown(evs) -> str:
    return "".join(e.text for e in evs if isinstance(e, Content))


def thought(evs) -> str:
    return "".join(e.text for e in evs if isinstance(e, Reasoning))


def halved_calls(text: str, want: list, style: str) -> list:
    """The events of ``text`` fed in two halves to ``style``'s parser, its calls checked against
    ``want``; ``[("search", None)]`` stands for a search call cut off in its arguments (max_tokens
    mid-way: the arguments as far as they came, the call ended). Returns the events."""
    evs = events(text, [len(text) // 2], style)
    if want == [("search", None)]:
        assert "".join(e.text for e in evs if isinstance(e, ToolArgs)) == '{"query": "cut'
        assert [e.name for e in evs if isinstance(e, ToolStart)] == ["search"] and isinstance(evs[-1], ToolEnd)
    else:
        assert calls(evs) == want
    return evs


@given(st.lists(st.integers(0, len(ANSWER)), max_size=6).map(sorted))
def test_a_list_of_calls_on_any_split_gives_each_call(cuts):
    evs = events(ANSWER, cuts)
    assert calls(evs) == WANT
    assert "".join(e.text for e in evs if isinstance(e, Reasoning)) == "The user wants the forecast."
    assert shown(evs) == "Checking."


@pytest.mark.parametrize("text, want, text_shown", [
    (TAG + ' [ ]', [], ""),                                                                   # an empty list
    (TAG + '[{"name": "search", "arguments": {"query": "x"}}]\n\nDone.', [("search", {"query": "x"})], "Done."),
    (TAG + '[{"name": "search", "arguments": {"query": "a"}}]' + TAG + '[{"name": "search", "arguments": {}}]',
     [("search", {"query": "a"}), ("search", {})], ""),                                      # two lists
    (TAG + 'not a list', [], TAG + "not a list"),                                             # the model's text
    (TAG + '[{"name": "search", "arguments": {"query": "a"}}, oops', [("search", {"query": "a"})], "oops"),
])
def test_granite_variants(text, want, text_shown):
    evs = events(text, [len(text) // 2])
    assert calls(evs) == want and shown(evs).strip() == text_shown


def test_a_call_cut_by_max_tokens_keeps_what_came():
    evs = events(TAG + '[{"name": "get_weather", "arguments": {"city": "Ly', [20])
    assert [e.name for e in evs if isinstance(e, ToolStart)] == ["get_weather"]
    assert "".join(e.text for e in evs if isinstance(e, ToolArgs)) == '{"city": "Ly' and isinstance(evs[-1], ToolEnd)


@pytest.fixture(scope="module")
def folder(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("granitemoe", extra_tags=(TAG,), max_position_embeddings=2048)
    return mark_special(with_template(src, tmp_path_factory.mktemp("granite") / "m", TEMPLATE), TAG)


def test_the_tag_is_special_yet_reaches_the_parser(folder):
    """Decoding leaves special tokens out; the stream decoder keeps the format's own tag, and only it."""
    tokenizer = Tokenizer(folder)
    assert tool_style(tokenizer) == "granite"
    ids = tokenizer.encode("Hi" + TAG + "[1]<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids) == "Hi[1]"
    for keep, want in (((), "Hi[1]"), ((TAG,), "Hi" + TAG + "[1]")):
        decoder = tokenizer.stream_decoder(keep)
        assert "".join(decoder.step(i) for i in ids) == want


def test_a_hermes_tokenizer_that_marks_its_tags_special_keeps_both(folder, tmp_path):
    """The JSON (Hermes) format's open and close tags, where the tokenizer marks them special,
    reach the parser too: the close ends the call, and what follows is content."""
    special = with_template(folder, tmp_path / "hermes", "{{ messages[0].content }}")
    for tag in ("<tool_call>", "</tool_call>"):
        mark_special(special, tag)
    tokenizer = Tokenizer(special)
    text = '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>\nDone.'
    ids = tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
    decoder = tokenizer.stream_decoder(format_tags("json"))
    assert "".join(decoder.step(i) for i in ids) == text
    p = OutputParser(tools=True, style="json")
    evs = p.feed(text) + p.finish()
    assert calls(evs) == [("search", {"query": "x"})] and shown(evs).strip() == "Done."


@pytest.fixture(scope="module")
def scripted(folder):
    answer = script(ANSWER, (TAG + '[{"name": "get_weather", "arguments": ', '{"city": "Rome", "days": 1}}]'),
                    (TAG + '[{"name": "', 'search", "arguments": {"query": "umbrellas"}}]'), "<|start_of_role|>tool")
    with recording_server(Tokenizer(folder), answer, max_context=4096) as srv:
        yield srv


def test_openai_chat_gets_both_calls(scripted):
    msg, got = chat_calls(scripted, MSGS, TOOLS)
    assert msg.reasoning_content == "The user wants the forecast." and msg.content == "Checking." and got == WANT


def test_openai_stream_gives_the_arguments_as_they_come(scripted):
    first, content = streamed(scripted, MSGS, TOOLS)
    assert len(first) > 1 and json.loads("".join(first)) == WANT[0][1]
    assert "[" not in content


def test_the_history_goes_back_in_the_format_and_forced_calls_are_prefilled(scripted):
    assert second_turn(scripted, MSGS, TOOLS) == "Sunny all three days."
    assert (TAG + '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
            '{"name": "search", "arguments": {"query": "rain [gear]"}}]') in scripted.prompts[-1]
    check_forced_calls(scripted, MSGS, TOOLS, '<|end_of_role|>' + TAG + '[{"name": "get_weather", "arguments": ')


def test_anthropic_gets_a_tool_use_block_per_call(scripted):
    assert tool_uses(scripted, MSGS, A_TOOLS) == WANT


# -- the grammar ------------------------------------------------------------------------------------
def held_prompt(style: str, forced: str | None = None, parallel: bool = True) -> Prompt:
    """A prompt in ``style`` whose tools (SCHEMAS) are all strict; ``forced``: "required" or a
    tool's name, the pre-fill already written."""
    return Prompt(ids=[1], in_reasoning=False, prefill="x" if forced else "", tools=True, style=style,
                  schemas=SCHEMAS, strict=frozenset(SCHEMAS), forced=forced, parallel=parallel)


prompt = functools.partial(held_prompt, "granite")


def walk(tokenizer, grammar: str, text: str) -> tuple[int, bool]:
    """Feed ``text`` under the masks: (tokens allowed, the grammar complete after them)."""
    return grammar_walk(tokenizer, tokenizer.vocab_size, grammar, text, None)


def allowed(tokenizer, grammar: str, text: str, keep: tuple[str, ...] = ()) -> str:
    """How much of ``text`` the masks let through (``keep``: special tags decoded too)."""
    ids = tokenizer.encode(text, add_special_tokens=False)[:walk(tokenizer, grammar, text)[0]]
    if not keep:
        return tokenizer.decode(ids)
    decoder = tokenizer.stream_decoder(keep)
    return "".join(decoder.step(i) for i in ids)


@pytest.mark.parametrize("text, wrong", [
    (' [{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}, {"name": "search", "arguments": '
     '{"query": "[x]"}}]', None),
    ('[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}]', "Oslo"),
    ('[{"name": "get_weather", "arguments": {"city": "Rome", "days": 9}}]', "9"),
    ('[{"name": "delete_all", "arguments": {}}]', "delete"),
    ('[{"name": "search", "arguments": {}}]', "}}]"),                                       # query required
])
def test_calls_after_the_tag_are_held_to_their_schemas(folder, text, wrong):
    tokenizer = Tokenizer(folder)
    held_to(tokenizer, tool_grammars(tokenizer, prompt())[0], text, wrong)


def held_to(tokenizer, grammar: str, text: str, wrong: str | None, keep: tuple[str, ...] = ()) -> None:
    """``text`` is allowed whole and completes ``grammar``; or, with ``wrong``, is cut where
    ``wrong`` starts (within a token or so; ``keep``: special tags counted too)."""
    n, complete = walk(tokenizer, grammar, text)
    if wrong is None:
        assert complete and n == len(tokenizer.encode(text, add_special_tokens=False))
    else:
        at = text.index(wrong)
        assert not complete and at - 4 <= len(allowed(tokenizer, grammar, text, keep)) < at + len(wrong)


def test_forced_rests_start_where_the_prefill_ends(folder):
    tokenizer = Tokenizer(folder)
    _, named = tool_grammars(tokenizer, prompt("get_weather"))
    assert walk(tokenizer, named, '{"city": "Paris", "days": 1}}]')[1]
    assert allowed(tokenizer, named, '{"city": "Paris", "days": 1}}, {').endswith("1}}")     # one call only
    _, required = tool_grammars(tokenizer, prompt("required"))
    assert walk(tokenizer, required, 'search", "arguments": {"query": "x"}}, {"name": "search", "arguments": '
                                     '{"query": "y"}}]')[1]
    _, single = tool_grammars(tokenizer, prompt("required", parallel=False))
    assert allowed(tokenizer, single, 'search", "arguments": {"query": "x"}}, {').endswith('"x"}}')


def forced_calls_are_valid(srv, seed: int, messages: list[dict], schemas: dict) -> None:
    """A random model answering ``tool_choice`` required, then named get_weather, through the
    live server: calls that parse and satisfy their schemas (but for a last one cut by
    ``max_tokens``, which a random model that keeps calling reaches), the named one by name."""
    client = srv.openai()
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in schemas.items()]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=srv.model, messages=messages, tools=tools, tool_choice=choice,
                                           max_tokens=200, temperature=1.0, seed=seed)
        got = r.choices[0].message.tool_calls
        assert got, r.choices[0]
        whole = got[:-1] if r.choices[0].finish_reason == "length" else got    # the last may be cut by max_tokens
        assert whole or len(got) == 1 and isinstance(choice, str)
        for c in whole:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
        if isinstance(choice, dict):
            assert [c.function.name for c in got] == ["get_weather"]


@pytest.mark.parametrize("seed", range(2))
def test_a_random_model_forced_to_call_writes_valid_calls(live, seed):
    forced_calls_are_valid(live, seed, MSGS, SCHEMAS)
