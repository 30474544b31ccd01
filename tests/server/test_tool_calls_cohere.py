"""Cohere's answers (Command A and its MoE, ``cohere2_moe``): reasoning between ``<|START_THINKING|>``
and ``<|END_THINKING|>``, the answer between ``<|START_RESPONSE|>`` and ``<|END_RESPONSE|>`` (not
shown), calls as one JSON list between ``<|START_ACTION|>`` and ``<|END_ACTION|>``, each
``{"tool_call_id": "N", "tool_name": "NAME", "parameters": {...}}``, one a line. The tags are special
tokens, kept for the parser with or without tools. Reasoning, answers and calls split on any split,
arguments streamed, through both official clients; forced calls pre-filled and held by a grammar;
a random ``cohere2_moe`` model forced to call through a live engine. The template is this test's
own, in Cohere's layout."""
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
                                     halved_calls, held_prompt, held_to, shown, thought, walk)
from tiny_models import with_template

from freetoken_engine.models.tokenizer import Tokenizer
from freetoken_engine.server.parser import ToolArgs, ToolEnd, ToolStart, output_parser
from freetoken_engine.server.prompt import build_prompt
from freetoken_engine.server.tool_grammar import tool_grammars

STYLE = "cohere"
OPEN, CLOSE = "<|START_ACTION|>", "<|END_ACTION|>"
THINK, THOUGHT = "<|START_THINKING|>", "<|END_THINKING|>"
SAY, SAID = "<|START_RESPONSE|>", "<|END_RESPONSE|>"
TURN = ("<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>")
TAGS = (OPEN, CLOSE, THINK, THOUGHT, SAY, SAID)
TEMPLATE = (
    "{%- if tools %}<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|># Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|END_OF_TURN_TOKEN|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role in ('system', 'user') %}<|START_OF_TURN_TOKEN|><|{{ m.role | upper }}_TOKEN|>{{ m.content }}"
    "<|END_OF_TURN_TOKEN|>"
    "{%- elif m.role == 'assistant' %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    "{%- if m.reasoning_content %}<|START_THINKING|>{{ m.reasoning_content }}<|END_THINKING|>{% endif %}"
    "{%- if m.tool_calls %}<|START_ACTION|>[\n{% for tc in m.tool_calls %}    {\"tool_call_id\": \"{{ loop.index0 }}\", "
    "\"tool_name\": \"{{ tc.function.name }}\", \"parameters\": {{ tc.function.arguments | tojson }}}"
    "{% if not loop.last %},{% endif %}\n{% endfor %}]<|END_ACTION|>"
    "{%- else %}<|START_RESPONSE|>{{ m.content }}<|END_RESPONSE|>{% endif %}<|END_OF_TURN_TOKEN|>"
    "{%- elif m.role == 'tool' %}<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TOOL_RESULT|>{{ m.content }}"
    "<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% endif %}")


def action(*calls_: tuple[str, str]) -> str:
    """A list of calls as Cohere writes it: one a line, indented."""
    lines = [f'    {{"tool_call_id": "{i}", "tool_name": "{name}", "parameters": {args}}}'
             for i, (name, args) in enumerate(calls_)]
    return OPEN + "[\n" + ",\n".join(lines) + "\n]" + CLOSE


ARGS = ('{"city": "Paris", "days": 3}', '{"query": "rain [gear] ]"}')
WANT = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "rain [gear] ]"})]
ANSWER = f"{THINK}The user wants the forecast.{THOUGHT}" + action(("get_weather", ARGS[0]), ("search", ARGS[1]))


@given(cuts=st.lists(st.integers(0, len(ANSWER)), max_size=6).map(sorted))
def test_reasoning_and_calls_on_any_split(cuts):
    evs = events(ANSWER, cuts, STYLE)
    assert calls(evs) == WANT
    assert thought(evs) == "The user wants the forecast." and shown(evs).strip() == ""


@pytest.mark.parametrize("text, want, text_shown, reasoning", [
    (f"{SAY}Seoul.{SAID}", [], "Seoul.", ""),                                        # reasoning off
    (f"{THINK}Plan.{THOUGHT}{SAY}Seoul.{SAID}", [], "Seoul.", "Plan."),
    (action(("get_time", "{}")), [("get_time", {})], "", ""),                        # calls only
    (OPEN + '[{"tool_name": "get_time", "tool_call_id": "0", "parameters": {}}]' + CLOSE,
     [("get_time", {})], "", ""),                                                    # keys in another order
    (OPEN + '[{"tool_call_id": "0", "tool_name": "search", "parameters": {"query": "cut', [("search", None)], "",
     ""),                                                                             # max_tokens mid-way
])
def test_cohere_variants(text, want, text_shown, reasoning):
    evs = halved_calls(text, want, STYLE)
    assert shown(evs).strip() == text_shown and thought(evs) == reasoning


def test_a_calls_name_starts_it_and_its_parameters_stream():
    p = output_parser(tools=True, style=STYLE)
    assert p.feed(OPEN + '[\n    {"tool_call_id": "0", "tool_name": "get_weather"') == []
    started = p.feed(', "parameters": {"city": ')
    assert [type(e) for e in started] == [ToolStart, ToolArgs] and started[0].name == "get_weather"
    assert [e.text for e in p.feed('"Paris"')] == ['"Paris"']
    assert [type(e) for e in p.feed("}}\n]" + CLOSE)] == [ToolArgs, ToolEnd]


@pytest.fixture(scope="module")
def folder(tiny_checkpoint, tmp_path_factory):
    return format_folder(tiny_checkpoint, tmp_path_factory, "cohere2_moe", TEMPLATE, TAGS,
                         TURN + ("<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>"))


def test_the_templates_format_is_read_and_its_special_tags_reach_the_parser(folder):
    special_tags_reach_the_parser(folder, STYLE, ANSWER, THINK)


def test_forced_calls_are_prefilled_and_close_an_open_reasoning(folder):
    tokenizer = Tokenizer(folder)
    p = build_prompt(tokenizer, MSGS, TOOLS, tool_choice="required")
    assert p.prefill == OPEN + '[{"tool_call_id": "0", "tool_name": "' and not p.in_reasoning
    p = build_prompt(tokenizer, MSGS, TOOLS, named_tool="search")
    assert p.prefill.endswith('"tool_name": "search", "parameters": ')
    thinking = Tokenizer(with_template(folder, folder.parent / "thinking", TEMPLATE.replace(
        "<|CHATBOT_TOKEN|>{% endif %}", "<|CHATBOT_TOKEN|><|START_THINKING|>{% endif %}")))
    p = build_prompt(thinking, MSGS, TOOLS, tool_choice="required")
    assert p.in_reasoning and p.prefill.startswith(THOUGHT + OPEN)


@pytest.fixture(scope="module")
def scripted(folder):
    named = OPEN + '[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": '
    required = OPEN + '[{"tool_call_id": "0", "tool_name": "'
    with_tools = script(ANSWER, (named, '{"city": "Rome", "days": 1}}]' + CLOSE),
                        (required, 'search", "parameters": {"query": "umbrellas"}}]' + CLOSE),
                        "<|START_TOOL_RESULT|>", reply=f"{SAY}Sunny all three days.{SAID}")
    with format_server(folder, named, with_tools, "# Tools", f"{THINK}Say bye.{THOUGHT}{SAY}Bye!{SAID}") as srv:
        yield srv


def test_both_clients_get_the_reasoning_and_each_call(scripted):
    msg, got = chat_calls(scripted, MSGS, TOOLS)
    assert (msg.reasoning_content, got) == ("The user wants the forecast.", WANT)
    assert tool_uses(scripted, MSGS, A_TOOLS) == WANT


def test_the_history_goes_back_in_the_format_and_forced_calls_are_prefilled(scripted):
    assert second_turn(scripted, MSGS, TOOLS) == "Sunny all three days."
    assert '"tool_name": "get_weather", "parameters": ' + json.dumps({"city": "Paris", "days": 3}) in scripted.prompts[-1]
    check_forced_calls(scripted, MSGS, TOOLS, scripted.named)


def test_without_tools_the_answer_is_split_from_the_reasoning(scripted):
    assert answered_without_tools(scripted) == ("Say bye.", "Bye!")


# -- the grammar ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, args, wrong", HELD)
def test_calls_after_the_tag_are_held_to_their_schemas(folder, name, args, wrong):
    """Cohere's list as it writes it (one call a line, indented), then ``<|END_ACTION|>``."""
    tokenizer = Tokenizer(folder)
    text = action((name, args), *([("search", '{"query": "x"}')] if wrong is None else []))[len(OPEN):]
    held_to(tokenizer, tool_grammars(tokenizer, held_prompt(STYLE))[0], text, wrong, TAGS)


def test_forced_rests_start_where_the_prefill_ends(folder):
    tokenizer = Tokenizer(folder)
    _, named = tool_grammars(tokenizer, held_prompt(STYLE, "get_weather"))
    assert walk(tokenizer, named, '{"city": "Paris", "days": 1}}]' + CLOSE)[1]
    assert not walk(tokenizer, named, '{"city": "Oslo", "days": 1}}]' + CLOSE)[1]
    _, single = tool_grammars(tokenizer, held_prompt(STYLE, "required", parallel=False))
    rest = 'search", "parameters": {"query": "x"}}, {"tool_call_id": "1"'
    assert '"1"' not in allowed(tokenizer, single, rest, TAGS)


@pytest.mark.parametrize("seed", range(2))
def test_a_random_cohere_model_forced_to_call_writes_valid_calls(live, seed):
    forced_calls_are_valid(live, seed, MSGS, SCHEMAS)
