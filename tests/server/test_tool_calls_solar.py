"""Solar Open's answers (``solar_open``): reasoning between ``<|think|>`` and ``<|end|>``, then an
assistant turn of its own, ``<|begin|>assistant<|content|>`` text, and/or ``<|begin|>assistant
<|tool_calls|>`` calls, ``<|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{...}<|tool_call:end|>``
each, until ``<|calls|>`` ends the generation. The markers are ordinary (not special) tokens.
Reasoning, content and calls split on any split, arguments streamed, through both official
clients; forced calls pre-filled (with an id of the pre-fill's own) and held by the grammar; a
random ``solar_open`` model forced to call through a live engine. The template is this test's
own, in Solar Open's layout."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from live import served_folder  # noqa: F401  (the live fixture)
from scripted import check_forced_calls, clients_get_the_calls, format_server, script, second_turn
from test_tool_calls_glm import calls
from test_tool_calls_granite import (A_TOOLS, HELD, MSGS, SCHEMAS, TOOLS, allowed, events, forced_calls_are_valid,
                                     halved_calls, held_prompt, held_to, shown, walk)
from tiny_models import with_template

from freetoken_engine.models.tokenizer import Tokenizer
from freetoken_engine.server.parser import OutputParser, Reasoning, ToolArgs, ToolEnd, ToolStart, format_tags
from freetoken_engine.server.parser_deepseek import SOLAR_ARGS, SOLAR_BEGIN, SOLAR_CALL_END, SOLAR_CALLS, SOLAR_NAME
from freetoken_engine.server.prompt import build_prompt, tool_style
from freetoken_engine.server.structured import guide_spec
from freetoken_engine.server.tool_grammar import tool_grammars

STYLE = "solar"
MARKS = ("<|think|>", "<|end|>", "<|begin|>", "<|content|>", "<|flush|>", "<|calls|>")
TAGS = (SOLAR_CALLS, SOLAR_BEGIN, SOLAR_NAME, SOLAR_ARGS, SOLAR_CALL_END)
TURN = "<|begin|>assistant"

TEMPLATE = (
    "{%- if tools %}<|begin|>system<|content|>## Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|end|>"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role in ('system', 'user') %}<|begin|>{{ m.role }}<|content|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' %}"
    "{%- if m.reasoning_content %}<|begin|>assistant<|think|>{{ m.reasoning_content }}<|end|>{% endif %}"
    "{%- if m.content %}<|begin|>assistant<|content|>{{ m.content }}<|end|>{% endif %}"
    "{%- if m.tool_calls %}<|begin|>assistant<|tool_calls|>{% for tc in m.tool_calls %}<|tool_call:begin|>{{ tc.id }}"
    "<|tool_call:name|>{{ tc.function.name }}<|tool_call:args|>{{ tc.function.arguments | tojson }}<|tool_call:end|>"
    "{% endfor %}<|calls|>{% endif %}"
    "{%- elif m.role == 'tool' %}<|begin|>tool:{{ m.tool_call_id }}<|content|>{{ m.content }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|begin|>assistant{% endif %}")


def call(name: str, args: str, cid: str = "a1b2c3d4e5") -> str:
    return f"{SOLAR_BEGIN}{cid}{SOLAR_NAME}{name}{SOLAR_ARGS}{args}{SOLAR_CALL_END}"


ARGS = ('{"city": "Paris", "days": 3}', '{"query": "rain <|tool_call:end|> [gear]"}')
WANT = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "rain <|tool_call:end|> [gear]"})]
BLOCK = SOLAR_CALLS + call("get_weather", ARGS[0]) + call("search", ARGS[1], "f6g7h8i9j0")
ANSWER = f"<|think|>The user wants the forecast.<|end|>{TURN}<|content|>Checking.<|end|>{TURN}{BLOCK}"


@given(cuts=st.lists(st.integers(0, len(ANSWER)), max_size=6).map(sorted))
def test_reasoning_content_and_calls_on_any_split(cuts):
    evs = events(ANSWER, cuts, STYLE)
    assert calls(evs) == WANT
    assert "".join(e.text for e in evs if isinstance(e, Reasoning)) == "The user wants the forecast."
    assert shown(evs) == "Checking."


@pytest.mark.parametrize("text, want, text_shown, reasoning", [
    ("<|content|>Hello!", [], "Hello!", ""),                                # reasoning switched off by the template
    (f"<|think|>Plan.<|end|>{TURN}<|content|>Seoul.", [], "Seoul.", "Plan."),
    (SOLAR_CALLS + call("get_time", "{}"), [("get_time", {})], "", ""),      # calls only
    (SOLAR_CALLS + call("get_time", ""), [("get_time", {})], "", ""),        # no arguments written
    (SOLAR_CALLS + SOLAR_BEGIN + "x1" + SOLAR_NAME + "search" + SOLAR_ARGS + '{"query": "cut', [("search", None)], "",
     ""),                                                                     # max_tokens mid-way
    (SOLAR_CALLS + SOLAR_BEGIN + "x1" + SOLAR_ARGS + "{}" + SOLAR_CALL_END, [],  # no name: the model's text
     SOLAR_CALLS + SOLAR_BEGIN + "x1" + SOLAR_ARGS + "{}" + SOLAR_CALL_END, ""),
])
def test_solar_variants(text, want, text_shown, reasoning):
    evs = halved_calls(text, want, STYLE)
    assert shown(evs).strip() == text_shown
    assert "".join(e.text for e in evs if isinstance(e, Reasoning)) == reasoning


def test_a_calls_name_starts_it_and_its_arguments_stream():
    p = OutputParser(tools=True, style=STYLE)
    assert p.feed(SOLAR_CALLS + SOLAR_BEGIN + "a1b2c3d4e5" + SOLAR_NAME + "get_weather") == []
    started = p.feed(SOLAR_ARGS + '{"city": ')
    assert [type(e) for e in started] == [ToolStart, ToolArgs] and started[0].name == "get_weather"
    assert [e.text for e in p.feed('"Paris"')] == ['"Paris"']
    assert [type(e) for e in p.feed("}" + SOLAR_CALL_END)] == [ToolArgs, ToolEnd]


@pytest.fixture(scope="module")
def folder(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("solar_open", extra_tags=MARKS + TAGS, max_position_embeddings=2048)
    return with_template(src, tmp_path_factory.mktemp("solar") / "m", TEMPLATE)


def test_the_templates_format_is_read_and_its_tags_reach_the_parser(folder):
    tokenizer = Tokenizer(folder)
    assert tool_style(tokenizer) == STYLE
    ids = tokenizer.encode(BLOCK, add_special_tokens=False)
    assert tokenizer.token_to_id(SOLAR_BEGIN) in ids
    decoder = tokenizer.stream_decoder(format_tags(STYLE))
    assert "".join(decoder.step(i) for i in ids) == BLOCK


def test_a_forced_call_inside_the_reasoning_closes_it_first(folder):
    """A template that opens the reasoning (``<|think|>`` at the end of its prompt): the pre-fill
    closes it and opens an assistant turn of calls; an answer's grammar waits for ``<|end|>``."""
    tokenizer = Tokenizer(with_template(folder, folder.parent / "thinking", TEMPLATE.replace(
        "<|begin|>assistant{% endif %}", "<|begin|>assistant<|think|>{% endif %}")))
    p = build_prompt(tokenizer, MSGS, TOOLS, tool_choice="required")
    assert p.in_reasoning and p.prefill == f"<|end|>{TURN}{SOLAR_CALLS}{SOLAR_BEGIN}0000000000{SOLAR_NAME}"
    spec = guide_spec('start: "ok"', tokenizer, build_prompt(tokenizer, MSGS, None))
    assert spec.reasoning and spec.close_reasoning == tokenizer.token_to_id("<|end|>")


@pytest.fixture(scope="module")
def scripted(folder):
    named = SOLAR_CALLS + SOLAR_BEGIN + "0000000000" + SOLAR_NAME + "get_weather" + SOLAR_ARGS
    required = SOLAR_CALLS + SOLAR_BEGIN + "0000000000" + SOLAR_NAME
    rest = '{"city": "Rome", "days": 1}' + SOLAR_CALL_END
    search = "search" + SOLAR_ARGS + '{"query": "umbrellas"}' + SOLAR_CALL_END
    with format_server(folder, named, script(ANSWER, (named, rest), (required, search), "<|begin|>tool:")) as srv:
        yield srv


def test_both_clients_get_the_reasoning_the_content_and_each_call(scripted):
    clients_get_the_calls(scripted, MSGS, TOOLS, A_TOOLS, WANT, "Checking.")


def test_the_history_goes_back_in_the_format_and_forced_calls_are_prefilled(scripted):
    assert second_turn(scripted, MSGS, TOOLS) == "Sunny all three days."
    prompt = scripted.prompts[-1]
    assert f"{SOLAR_NAME}get_weather{SOLAR_ARGS}" + '{"city": "Paris", "days": 3}' in prompt
    assert f"{TURN}<|content|>Checking.<|end|>{TURN}{SOLAR_CALLS}" in prompt
    check_forced_calls(scripted, MSGS, TOOLS, TURN + scripted.named)


# -- the grammar ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, args, wrong", HELD)
def test_calls_after_the_tag_are_held_to_their_schemas(folder, name, args, wrong):
    tokenizer = Tokenizer(folder)
    text = call(name, args) + (call("search", '{"query": "x"}') if wrong is None else "")
    held_to(tokenizer, tool_grammars(tokenizer, held_prompt(STYLE))[0], text, wrong, TAGS)


def test_forced_rests_start_where_the_prefill_ends(folder):
    tokenizer = Tokenizer(folder)
    _, named = tool_grammars(tokenizer, held_prompt(STYLE, "get_weather"))
    assert walk(tokenizer, named, '{"city": "Paris", "days": 1}' + SOLAR_CALL_END)[1]
    got = allowed(tokenizer, named, '{"city": "Paris", "days": 1}' + SOLAR_CALL_END + SOLAR_BEGIN, TAGS)
    assert got.startswith('{"city": "Paris", "days": 1}') and SOLAR_BEGIN not in got      # one call only
    two = call("search", '{"query": "x"}') + call("search", '{"query": "y"}')
    skip = len(SOLAR_BEGIN + "a1b2c3d4e5" + SOLAR_NAME)
    _, required = tool_grammars(tokenizer, held_prompt(STYLE, "required"))
    assert walk(tokenizer, required, two[skip:])[1]
    _, single = tool_grammars(tokenizer, held_prompt(STYLE, "required", parallel=False))
    assert '"y"' not in allowed(tokenizer, single, two[skip:], TAGS)


@pytest.mark.parametrize("seed", range(2))
def test_a_random_solar_model_forced_to_call_writes_valid_calls(live, seed):
    forced_calls_are_valid(live, seed, MSGS, SCHEMAS)
