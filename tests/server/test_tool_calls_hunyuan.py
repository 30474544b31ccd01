"""Tool calls in Hunyuan-A13B's format: the answer between ``<answer>`` tags (not shown), calls as
a JSON list between ``<tool_calls>`` tags. Parsed on any split, through the official OpenAI and
Anthropic clients, the history rendered back by the template, named and required calls
pre-filled and held to their schemas by the grammar, and a random ``hunyuan_v1_moe`` model forced
to call through a live engine. The template is this test's own, in Hunyuan's layout; scripted
answers come from a ``ScriptedService``."""
from __future__ import annotations

import functools
import pytest
from hypothesis import given
from hypothesis import strategies as st
from live import served_folder  # noqa: F401  (the live fixture)
from scripted import chat_calls, check_forced_calls, recording_server, script, second_turn, tool_uses
from test_tool_calls_glm import calls
from test_tool_calls_granite import (A_TOOLS, MSGS, SCHEMAS, TOOLS, allowed, forced_calls_are_valid, held_prompt, held_to,
                                     shown, walk)
from tiny_models import with_template

from freetoken_engine.models.tokenizer import Tokenizer
from freetoken_engine.server.parser import OutputParser, Reasoning
from freetoken_engine.server.prompt import tool_style
from freetoken_engine.server.tool_grammar import tool_grammars

OPEN, CLOSE = "<tool_calls>", "</tool_calls>"
TEMPLATE = (
    "{%- if tools %}<|startoftext|>Tools: {% for tool in tools %}{{ tool | tojson }}{% endfor %}<|extra_0|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|startoftext|>{{ m.content }}<|extra_0|>"
    "{%- elif m.role == 'assistant' %}<answer>\n{{ m.content or '' }}"
    "{%- if m.tool_calls %}<tool_calls>[{%- for tc in m.tool_calls %}{% set f = tc.function if tc.function is defined else tc %}"
    "{\"name\": {{ f.name | tojson }}, \"arguments\": {{ f.arguments | tojson }}}{% if not loop.last %}, {% endif %}"
    "{%- endfor %}]</tool_calls>{%- endif %}\n</answer><|im_end|>"
    "{%- elif m.role == 'tool' %}<|startoftext|><tool_response>{{ m.content }}</tool_response><|extra_0|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|startoftext|>{% endif %}")
LIST = '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "search", "arguments": {"query": "rain [gear]"}}]'
ANSWER = "<think>\nThe user wants the forecast.\n</think>\n<answer>\nChecking." + OPEN + LIST + CLOSE + "\n</answer>"
WANT = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "rain [gear]"})]


def events(text: str, cuts: list[int], tools: bool = True) -> list:
    p = OutputParser(tools=tools, style="hunyuan")
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [e for piece in pieces for e in p.feed(piece)] + p.finish()


@given(st.lists(st.integers(0, len(ANSWER)), max_size=6).map(sorted))
def test_a_list_of_calls_on_any_split_gives_each_call(cuts):
    evs = events(ANSWER, cuts)
    assert calls(evs) == WANT
    assert "".join(e.text for e in evs if isinstance(e, Reasoning)).strip() == "The user wants the forecast."
    assert shown(evs) == "Checking."


@pytest.mark.parametrize("text, tools, want, text_shown", [
    ("<think>\nhm\n</think>\n<answer>\nParis is sunny.\n</answer>", False, [], "Paris is sunny."),   # tags not shown
    ("<answer>\nParis is sunny.\n</answer>", True, [], "Paris is sunny."),
    (OPEN + '[{"name": "f", "arguments": {}}]' + CLOSE + " Done.", True, [("f", {})], "Done."),
    (OPEN + "not a list" + CLOSE, True, [], OPEN + "not a list"),                          # shown, close dropped
])
def test_hunyuan_variants(text, tools, want, text_shown):
    evs = events(text, [len(text) // 2], tools)
    assert calls(evs) == want and shown(evs).strip() == text_shown


@pytest.fixture(scope="module")
def folder(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("hunyuan_v1_moe", extra_tags=(OPEN, CLOSE), max_position_embeddings=2048)
    return with_template(src, tmp_path_factory.mktemp("hunyuan") / "m", TEMPLATE)


def test_the_template_is_read_as_hunyuans_format(folder):
    assert tool_style(Tokenizer(folder)) == "hunyuan"


@pytest.fixture(scope="module")
def scripted(folder):
    answer = script(ANSWER, (OPEN + '[{"name": "get_weather", "arguments": ', '{"city": "Rome", "days": 1}}]' + CLOSE),
                    (OPEN + '[{"name": "', 'search", "arguments": {"query": "umbrellas"}}]' + CLOSE), "<tool_response>",
                    reply="<answer>\nSunny all three days.\n</answer>")
    with recording_server(Tokenizer(folder), answer, max_context=4096) as srv:
        yield srv


def test_openai_chat_gets_both_calls(scripted):
    msg, got = chat_calls(scripted, MSGS, TOOLS)
    assert msg.reasoning_content.strip() == "The user wants the forecast." and msg.content == "Checking." and got == WANT


def test_the_history_goes_back_in_the_format_and_forced_calls_are_prefilled(scripted):
    assert second_turn(scripted, MSGS, TOOLS) == "Sunny all three days."
    assert OPEN + '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}' in scripted.prompts[-1]
    check_forced_calls(scripted, MSGS, TOOLS, "<|startoftext|>" + OPEN + '[{"name": "get_weather", "arguments": ')


def test_anthropic_gets_a_tool_use_block_per_call(scripted):
    assert tool_uses(scripted, MSGS, A_TOOLS) == WANT


prompt = functools.partial(held_prompt, "hunyuan")


@pytest.mark.parametrize("text, wrong", [
    ('[{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}, {"name": "search", "arguments": '
     '{"query": "[x]"}}]' + CLOSE, None),
    ('[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}]' + CLOSE, "Oslo"),
    ('[{"name": "delete_all", "arguments": {}}]' + CLOSE, "delete"),
])
def test_calls_after_the_tag_are_held_to_their_schemas(folder, text, wrong):
    tokenizer = Tokenizer(folder)
    held_to(tokenizer, tool_grammars(tokenizer, prompt())[0], text, wrong)


def test_forced_rests_start_where_the_prefill_ends(folder):
    tokenizer = Tokenizer(folder)
    _, named = tool_grammars(tokenizer, prompt("get_weather"))
    assert walk(tokenizer, named, '{"city": "Paris", "days": 1}}]' + CLOSE)[1]
    got = allowed(tokenizer, named, '{"city": "Paris", "days": 1}}, {"name": "search"')        # one call only
    assert got.startswith('{"city": "Paris", "days": 1}}') and "search" not in got


@pytest.mark.parametrize("seed", range(2))
def test_a_random_hunyuan_model_forced_to_call_writes_valid_calls(live, seed):
    forced_calls_are_valid(live, seed, MSGS, SCHEMAS)
