"""Tool calls in MiniMax-M2's format: one ``<minimax:tool_call>`` block holding each call of the
turn as ``<invoke name="NAME">`` with ``<parameter name="KEY">VALUE</parameter>`` elements.
Parsed on any split into typed JSON arguments, several calls to a block, through the official
OpenAI and Anthropic clients (streamed a parameter at a time), the history rendered back in the
format by the template, named and required calls pre-filled, and held to their schemas by the
grammar: hand-written calls token by token, and a random ``minimax_m2`` model forced to call
through a live engine. The template is this test's own, in MiniMax-M2's layout;
scripted answers come from a ``ScriptedService``."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from live import serving
from scripted import chat_calls, check_forced_calls, recording_server, script, second_turn, streamed, tool_uses
from test_tool_calls_glm import calls
from test_tool_calls_granite import SCHEMAS as HELD
from test_tool_calls_granite import allowed, forced_calls_are_valid, held_to, walk
from tiny_models import with_template

from freetoken_engine.models.tokenizer import Tokenizer
from freetoken_engine.server.parser import Content, OutputParser, Reasoning
from freetoken_engine.server.prompt import Prompt, tool_style
from freetoken_engine.server.tool_grammar import tool_grammars

TEMPLATE = (
    "{%- if tools %}]~!b[]~b]system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call tools as <minimax:tool_call>\n<invoke name=\"NAME\">\n<parameter name=\"KEY\">VALUE</parameter>\n"
    "</invoke>\n</minimax:tool_call>[e~[\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}]~b]ai\n{% if m.content %}{{ m.content }}{% endif %}"
    "{%- if m.tool_calls %}\n<minimax:tool_call>\n{% for tc in m.tool_calls %}"
    "{%- set f = tc.function if tc.function is defined else tc %}<invoke name=\"{{ f.name }}\">\n"
    "{% for k, v in f.arguments.items() %}<parameter name=\"{{ k }}\">{{ v | tojson if v is not string else v }}"
    "</parameter>\n{% endfor %}</invoke>\n{% endfor %}</minimax:tool_call>{% endif %}[e~[\n"
    "{%- elif m.role == 'tool' %}]~b]tool\n<response>{{ m.content }}</response>[e~[\n"
    "{%- else %}]~b]{{ m.role }}\n{{ m.content if m.content is string else '' }}[e~[\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}]~b]ai\n{% endif %}")
BLOCK = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
         '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="search">\n'
         '<parameter name="query">rain <b>gear</b></parameter>\n</invoke>\n</minimax:tool_call>')
ANSWER = "<think>The user wants the forecast.</think>\n\nChecking.\n" + BLOCK
WANT = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "rain <b>gear</b>"})]
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
           "search": {"type": "object", "properties": {"query": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
A_TOOLS = [{"name": n, "description": n, "input_schema": s} for n, s in SCHEMAS.items()]
MSGS = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
NAMED_REST = '<parameter name="city">Rome</parameter>\n<parameter name="days">1</parameter>\n</invoke>\n</minimax:tool_call>'


def events(text: str, cuts: list[int]) -> list:
    p = OutputParser(tools=True, style="minimax", schemas=SCHEMAS)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [e for piece in pieces for e in p.feed(piece)] + p.finish()


@given(st.lists(st.integers(0, len(ANSWER)), max_size=6).map(sorted))
def test_a_block_of_calls_on_any_split_gives_typed_arguments(cuts):
    evs = events(ANSWER, cuts)
    assert calls(evs) == WANT
    assert "".join(e.text for e in evs if isinstance(e, Reasoning)) == "The user wants the forecast."
    shown = "".join(e.text for e in evs if isinstance(e, Content))
    assert shown.strip() == "Checking." and "<" not in shown


@pytest.mark.parametrize("text, want", [
    # no newlines; a value holding another tag; two blocks
    ('<minimax:tool_call><invoke name="search"><parameter name="query">a <parameter name="x"> b</parameter>'
     '</invoke></minimax:tool_call><minimax:tool_call><invoke name="get_weather"></invoke></minimax:tool_call>',
     [("search", {"query": 'a <parameter name="x"> b'}), ("get_weather", {})]),
    ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Ly',     # cut by max_tokens
     [("get_weather", {"city": "Ly"})]),
])
def test_minimax_variants_parse(text, want):
    assert calls(events(text, [len(text) // 2])) == want


def test_a_block_without_a_call_is_shown_as_the_models_text():
    block = "<minimax:tool_call>not a call</minimax:tool_call>"
    evs = events(block + " done", [7])
    shown = "".join(e.text for e in evs if isinstance(e, Content))
    assert calls(evs) == [] and shown.startswith(block) and shown.endswith("done")


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint, tmp_path_factory):
    return Tokenizer(with_template(tiny_checkpoint("qwen3_moe"), tmp_path_factory.mktemp("minimax") / "m", TEMPLATE))


@pytest.fixture(scope="module")
def scripted(tokenizer):
    assert tool_style(tokenizer) == "minimax"

    answer = script(ANSWER, ('<invoke name="get_weather">\n', NAMED_REST),
                    ('<invoke name="', 'search">\n<parameter name="query">umbrellas</parameter>\n</invoke>\n'
                                       '</minimax:tool_call>'), "<response>", "<think>Sunny.</think>\n\nSunny all three days.")
    with recording_server(tokenizer, answer, max_context=4096) as srv:
        yield srv


def test_openai_chat_gets_both_calls_as_typed_json_arguments(scripted):
    msg, got = chat_calls(scripted, MSGS, TOOLS)
    assert msg.reasoning_content == "The user wants the forecast." and msg.content.strip() == "Checking."
    assert got == WANT


def test_openai_stream_gives_the_arguments_a_parameter_at_a_time(scripted):
    first, content = streamed(scripted, MSGS, TOOLS)
    assert len(first) == 3 and json.loads("".join(first)) == WANT[0][1]
    assert "<" not in content


def test_the_history_goes_back_in_the_format_and_forced_calls_are_prefilled(scripted):
    assert second_turn(scripted, MSGS, TOOLS) == "Sunny all three days."
    assert ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
            '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="search">') in scripted.prompts[-1]
    check_forced_calls(scripted, MSGS, TOOLS, ']~b]ai\n<minimax:tool_call>\n<invoke name="get_weather">\n')


def test_anthropic_gets_a_tool_use_block_per_call(scripted):
    assert tool_uses(scripted, MSGS, A_TOOLS) == WANT


# -- the grammar ------------------------------------------------------------------------------------
def held(forced: str | None = None, parallel: bool = True) -> Prompt:
    return Prompt(ids=[1], in_reasoning=False, prefill="x" if forced else "", tools=True, style="minimax",
                  schemas=HELD, strict=frozenset(HELD), forced=forced, parallel=parallel)


CALLS = ('\n<invoke name="get_weather">\n<parameter name="city">Rome</parameter>\n<parameter name="days">3'
         '</parameter>\n</invoke>\n<invoke name="search">\n<parameter name="query">what is <b>bold</b>?</parameter>\n'
         '</invoke>\n</minimax:tool_call>')


@pytest.mark.parametrize("text, wrong", [
    (CALLS, None),
    ('<invoke name="get_weather"><parameter name="city">Rome</parameter><parameter name="days">3</parameter>'
     '</invoke></minimax:tool_call>', "><"),                                            # the newlines are the format's
    ('\n<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n', "Oslo"),
    ('\n<invoke name="get_weather">\n<parameter name="days">3</parameter>\n', "days"),   # city first, required
    ('\n<invoke name="get_weather">\n<parameter name="city">Rome</parameter>\n<parameter name="days">9', "9"),
    ('\n<invoke name="delete_all">\n', "delete"),
    ('\n<invoke name="search">\n</invoke>\n', "</invoke>"),                               # query required
])
def test_calls_after_the_tag_are_held_to_their_schemas(tokenizer, text, wrong):
    held_to(tokenizer, tool_grammars(tokenizer, held())[0], text, wrong)


def test_forced_rests_start_where_the_prefill_ends(tokenizer):
    _, named = tool_grammars(tokenizer, held("get_weather"))
    rest = '<parameter name="city">Paris</parameter>\n<parameter name="days">1</parameter>\n</invoke>\n'
    assert walk(tokenizer, named, rest + "</minimax:tool_call>")[1]
    assert "<invoke" not in allowed(tokenizer, named, rest + '<invoke name="search">')      # one call only
    _, required = tool_grammars(tokenizer, held("required"))
    assert walk(tokenizer, required, 'search">\n<parameter name="query">x</parameter>\n</invoke>\n' + CALLS)[1]
    _, single = tool_grammars(tokenizer, held("required", parallel=False))
    assert "<invoke" not in allowed(tokenizer, single, 'search">\n<parameter name="query">x</parameter>\n</invoke>\n'
                                                       '<invoke')


@pytest.fixture(scope="module")
def live(tiny_checkpoint, tmp_path_factory):
    folder = with_template(tiny_checkpoint("minimax_m2", max_position_embeddings=2048),
                           tmp_path_factory.mktemp("minimax-engine") / "m", TEMPLATE)
    with serving(folder, max_context=1024) as srv:
        yield srv


@pytest.mark.parametrize("seed", range(2))
def test_a_random_minimax_model_forced_to_call_writes_valid_calls(live, seed):
    forced_calls_are_valid(live, seed, MSGS, HELD)
