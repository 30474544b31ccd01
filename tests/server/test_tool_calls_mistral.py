"""Mistral's answers (Mistral Small 3.2+, Devstral, Magistral, Mistral Small 4: its tokenizers' v11
format and later): reasoning between ``[THINK]`` and ``[/THINK]``, each call ``[TOOL_CALLS]NAME[ARGS]
{...}`` (an id after ``[CALL_ID]`` passed over), no closing tag. The tags are special tokens, kept for
the parser with or without tools. Reasoning, content and calls split on any split, arguments
streamed, through both official clients; forced calls pre-filled and held by a grammar; a random
``mistral`` model forced to call through a live engine. The template is this test's own, in
Mistral's layout."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from format_cases import answered_without_tools, format_folder, special_tags_reach_the_parser
from live import served_folder  # noqa: F401  (the live fixture)
from scripted import chat_calls, check_forced_calls, format_server, script, second_turn, tool_uses
from test_tool_calls_glm import calls
from test_tool_calls_granite import (A_TOOLS, HELD, MSGS, SCHEMAS, TOOLS, allowed, events, forced_calls_are_valid,
                                     held_prompt, held_to, shown, thought, walk)
from tiny_models import with_template

from freetoken_engine.models.tokenizer import Tokenizer
from freetoken_engine.server.parser import ToolArgs, ToolEnd, ToolStart, output_parser
from freetoken_engine.server.prompt import build_prompt
from freetoken_engine.server.tool_grammar import tool_grammars

STYLE = "mistral"
CALLS, ARGS_TAG, CALL_ID, THINK, THOUGHT = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"
TAGS = (CALLS, ARGS_TAG, CALL_ID, THINK, THOUGHT)
TEMPLATE = (
    "<s>{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}[SYSTEM_PROMPT]{{ m.content }}[/SYSTEM_PROMPT]"
    "{%- elif m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' %}"
    "{%- if m.reasoning_content %}[THINK]{{ m.reasoning_content }}[/THINK]{% endif %}"
    "{%- if m.content %}{{ m.content }}{% endif %}"
    "{%- for tc in m.tool_calls or [] %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}"
    "{%- endfor %}</s>"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}")


def call(name: str, args: str, call_id: str | None = None) -> str:
    return CALLS + name + (CALL_ID + call_id if call_id else "") + ARGS_TAG + args


ARGS = ('{"city": "Paris", "days": 3}', '{"query": "rain [gear] {x}"}')
WANT = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "rain [gear] {x}"})]
ANSWER = f"{THINK}The user wants the forecast.{THOUGHT}Checking." + call("get_weather", ARGS[0]) + \
    call("search", ARGS[1], "a1b2c3d4e")


@given(cuts=st.lists(st.integers(0, len(ANSWER)), max_size=6).map(sorted))
def test_reasoning_content_and_calls_on_any_split(cuts):
    evs = events(ANSWER, cuts, STYLE)
    assert calls(evs) == WANT
    assert thought(evs) == "The user wants the forecast." and shown(evs) == "Checking."


@pytest.mark.parametrize("text, want, text_shown", [
    ("Seoul.", [], "Seoul."),                                                       # no reasoning, no call
    (call("get_time", "{}"), [("get_time", {})], ""),                               # a call only
    (call("get_time", ""), [("get_time", {})], ""),                                 # no arguments written
    (call("get_time", "{}") + "\n\nDone.", [("get_time", {})], "Done."),           # text after the calls
    (CALLS + '[{"name": "get_time", "arguments": {}}]', [], CALLS + '[{"name": "get_time", "arguments": {}}]'),
])                                                                                  # the old list form: text
def test_mistral_variants(text, want, text_shown):
    evs = events(text, [len(text) // 2], STYLE)
    assert calls(evs) == want and shown(evs).strip() == text_shown


def test_a_calls_name_starts_it_and_its_arguments_stream_and_a_cut_call_keeps_what_came():
    p = output_parser(tools=True, style=STYLE)
    assert p.feed(CALLS + "get_weather") == []
    started = p.feed(ARGS_TAG + '{"city": ')
    assert [type(e) for e in started] == [ToolStart, ToolArgs] and started[0].name == "get_weather"
    assert [e.text for e in p.feed('"Paris"')] == ['"Paris"']
    assert [type(e) for e in p.finish()] == [ToolEnd]                              # max_tokens mid-way


@pytest.fixture(scope="module")
def folder(tiny_checkpoint, tmp_path_factory):
    return format_folder(tiny_checkpoint, tmp_path_factory, "mistral", TEMPLATE, TAGS,
                         ("[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[INST]", "[/INST]", "[TOOL_RESULTS]",
                          "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"))


def test_the_templates_format_is_read_and_its_special_tags_reach_the_parser(folder):
    special_tags_reach_the_parser(folder, STYLE, ANSWER, CALLS)


def test_forced_calls_are_prefilled_and_close_an_open_reasoning(folder):
    tokenizer = Tokenizer(folder)
    assert build_prompt(tokenizer, MSGS, TOOLS, tool_choice="required").prefill == CALLS
    assert build_prompt(tokenizer, MSGS, TOOLS, named_tool="search").prefill == CALLS + "search" + ARGS_TAG
    thinking = Tokenizer(with_template(folder, folder.parent / "thinking", TEMPLATE + "[THINK]"))
    p = build_prompt(thinking, MSGS, TOOLS, tool_choice="required")
    assert p.in_reasoning and p.prefill == THOUGHT + CALLS


@pytest.fixture(scope="module")
def scripted(folder):
    named = CALLS + "get_weather" + ARGS_TAG
    with_tools = script(ANSWER, (named, '{"city": "Rome", "days": 1}'), (CALLS, 'search[ARGS]{"query": "umbrellas"}'),
                        "[TOOL_RESULTS]", reply="Sunny all three days.")
    with format_server(folder, named, with_tools, "[AVAILABLE_TOOLS]", f"{THINK}Say bye.{THOUGHT}Bye!") as srv:
        yield srv


def test_both_clients_get_the_reasoning_the_content_and_each_call(scripted):
    msg, got = chat_calls(scripted, MSGS, TOOLS)
    assert (msg.reasoning_content, msg.content, got) == ("The user wants the forecast.", "Checking.", WANT)
    assert tool_uses(scripted, MSGS, A_TOOLS) == WANT


def test_the_history_goes_back_in_the_format_and_forced_calls_are_prefilled(scripted):
    assert second_turn(scripted, MSGS, TOOLS) == "Sunny all three days."
    assert CALLS + "get_weather" + ARGS_TAG + json.dumps({"city": "Paris", "days": 3}) in scripted.prompts[-1]
    check_forced_calls(scripted, MSGS, TOOLS, scripted.named)


def test_without_tools_the_answer_is_split_from_the_reasoning(scripted):
    assert answered_without_tools(scripted) == ("Say bye.", "Bye!")


# -- the grammar ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, args, wrong", HELD)
def test_calls_after_the_tag_are_held_to_their_schemas(folder, name, args, wrong):
    tokenizer = Tokenizer(folder)
    text = call(name, args)[len(CALLS):] + (call("search", '{"query": "x"}') if wrong is None else "")
    held_to(tokenizer, tool_grammars(tokenizer, held_prompt(STYLE))[0], text, wrong, TAGS)


def test_forced_rests_start_where_the_prefill_ends(folder):
    tokenizer = Tokenizer(folder)
    _, named = tool_grammars(tokenizer, held_prompt(STYLE, "get_weather"))
    assert walk(tokenizer, named, '{"city": "Paris", "days": 1}')[1]
    assert not walk(tokenizer, named, '{"city": "Oslo", "days": 1}')[1]
    _, single = tool_grammars(tokenizer, held_prompt(STYLE, "required", parallel=False))
    assert '"y"' not in allowed(tokenizer, single, 'search[ARGS]{"query": "x"}' + call("search", '{"query": "y"}'),
                                TAGS)


@pytest.mark.parametrize("seed", range(2))
def test_a_random_mistral_model_forced_to_call_writes_valid_calls(live, seed):
    forced_calls_are_valid(live, seed, MSGS, SCHEMAS)
