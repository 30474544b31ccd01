"""Tool calls in DeepSeek's tokens: V3.1's ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``
and V3 / R1's fenced form (``function<｜tool▁sep｜>NAME`` and a ```` ```json ```` block), every tag a
special token, which decoding would leave out. Parsed on any split, arguments streamed, through
the official OpenAI and Anthropic clients, the history rendered back by the template, named and
required calls pre-filled and held to their schemas by the grammar: hand-written calls token by
token, and a random ``deepseek_v3`` model (latent attention) forced to call through a live
engine. The templates are this test's own, in DeepSeek's layouts; scripted answers come from a
``ScriptedService``."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from live import serving
from scripted import check_forced_calls, clients_get_the_calls, recording_server, script, second_turn
from test_tool_calls_glm import calls
from test_tool_calls_granite import (A_TOOLS, HELD, MSGS, SCHEMAS, TOOLS, allowed, events, forced_calls_are_valid,
                                     halved_calls, held_prompt, held_to,
                                     shown, walk)
from tiny_models import mark_special, with_template

from freetoken_engine.models.tokenizer import Tokenizer
from freetoken_engine.server.parser import OutputParser, Reasoning, ToolArgs, ToolEnd, ToolStart, format_tags
from freetoken_engine.server.parser_deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, TAGS
from freetoken_engine.server.prompt import tool_style
from freetoken_engine.server.tool_grammar import tool_grammars


def template(fenced: bool) -> str:
    """DeepSeek's chat layout; V3.1's calls, or V3's fenced ones."""
    call = ("'<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + tc.function.name + '\\n```json\\n' + "
            "(tc.function.arguments | tojson) + '\\n```<｜tool▁call▁end｜>'" if fenced else
            "'<｜tool▁call▁begin｜>' + tc.function.name + '<｜tool▁sep｜>' + (tc.function.arguments | tojson) + "
            "'<｜tool▁call▁end｜>'")
    return (
        "{%- if tools %}## Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{%- endif %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'user' %}<｜User｜>{{ m.content }}"
        "{%- elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content or '' }}"
        "{%- if m.tool_calls %}<｜tool▁calls▁begin｜>{%- for tc in m.tool_calls %}{{ " + call + " }}{%- endfor %}"
        "<｜tool▁calls▁end｜>{%- endif %}<|im_end|>"
        "{%- elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}")


def v31(name: str, args: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


def fenced(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


ARGS = ('{"city": "Paris", "days": 3}', '{"query": "rain <｜tool▁call▁end｜> [gear]"}')
WANT = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "rain <｜tool▁call▁end｜> [gear]"})]
BLOCKS = {style: CALLS_BEGIN + write("get_weather", ARGS[0]) + write("search", ARGS[1]) + CALLS_END
          for style, write in (("deepseek", v31), ("deepseek_fenced", fenced))}


def answer(style: str) -> str:
    return "<think>The user wants the forecast.</think>\n\nChecking." + BLOCKS[style] + " Done."


@pytest.mark.parametrize("style", ["deepseek", "deepseek_fenced"])
@given(cuts=st.lists(st.integers(0, len(answer("deepseek_fenced"))), max_size=6).map(sorted))
def test_a_block_of_calls_on_any_split_gives_each_call(style, cuts):
    """A closing tag inside a JSON string is the argument's text, not the call's end."""
    evs = events(answer(style), [c for c in cuts if c <= len(answer(style))], style)
    assert calls(evs) == WANT
    assert "".join(e.text for e in evs if isinstance(e, Reasoning)) == "The user wants the forecast."
    assert shown(evs) == "Checking.Done."


@pytest.mark.parametrize("text, want, text_shown", [
    (CALLS_BEGIN + v31("get_time", "{}") + CALLS_END, [("get_time", {})], ""),
    (CALLS_BEGIN + v31("get_time", "") + CALLS_END, [("get_time", {})], ""),              # no arguments written
    (CALLS_BEGIN + "\n" + v31("f", '{"a": [1, {"b": null}]}') + "\n" + v31("g", "{}") + "\n" + CALLS_END + "x",
     [("f", {"a": [1, {"b": None}]}), ("g", {})], "x"),
    (CALLS_BEGIN + CALL_BEGIN + "search" + SEP + '{"query": "cut', [("search", None)], ""),  # max_tokens mid-way
    (CALLS_BEGIN + "not a call" + CALLS_END, [], CALLS_BEGIN + "not a call" + CALLS_END),  # shown as text
    (CALLS_BEGIN + v31("f", "{}") + "oops", [("f", {})], "oops"),                          # text after a call
    (CALLS_BEGIN + CALL_BEGIN + "f" + CALL_END, [], CALLS_BEGIN + CALL_BEGIN + "f" + CALL_END),   # no separator
])
def test_deepseek_variants(text, want, text_shown):
    evs = halved_calls(text, want, "deepseek")
    assert shown(evs).strip() == text_shown


def test_a_calls_name_starts_it_and_its_arguments_stream():
    """The call starts once its name is read; its arguments come in pieces, not at the close."""
    p = OutputParser(tools=True, style="deepseek")
    assert p.feed(CALLS_BEGIN + CALL_BEGIN + "get_weather") == []
    started = p.feed(SEP + '{"city": ')
    assert [type(e) for e in started] == [ToolStart, ToolArgs] and started[0].name == "get_weather"
    assert [e.text for e in p.feed('"Paris"')] == ['"Paris"']
    assert [type(e) for e in p.feed("}" + CALL_END + CALLS_END)] == [ToolArgs, ToolEnd]


@pytest.fixture(scope="module", params=["deepseek", "deepseek_fenced"])
def folder(request, tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("deepseek_v3", extra_tags=TAGS, max_position_embeddings=2048)
    out = with_template(src, tmp_path_factory.mktemp(request.param) / "m", template(request.param == "deepseek_fenced"))
    for tag in TAGS:
        mark_special(out, tag)
    return request.param, out


def test_the_templates_format_is_read_and_its_special_tags_reach_the_parser(folder):
    style, path = folder
    tokenizer = Tokenizer(path)
    assert tool_style(tokenizer) == style
    ids = tokenizer.encode(BLOCKS[style] + " ok<|im_end|>", add_special_tokens=False)
    assert CALLS_BEGIN not in tokenizer.decode(ids)
    decoder = tokenizer.stream_decoder(format_tags(style))
    assert "".join(decoder.step(i) for i in ids) == BLOCKS[style] + " ok"


@pytest.fixture(scope="module")
def scripted(folder):
    style, path = folder
    write = v31 if style == "deepseek" else fenced
    named = (CALLS_BEGIN + CALL_BEGIN + "get_weather" + SEP) if style == "deepseek" else \
        (CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "get_weather\n```json\n")
    required = CALLS_BEGIN + CALL_BEGIN + ("" if style == "deepseek" else "function" + SEP)
    rest = '{"city": "Rome", "days": 1}' + (CALL_END if style == "deepseek" else "\n```" + CALL_END) + CALLS_END
    search = write("search", '{"query": "umbrellas"}')[len(required) - len(CALLS_BEGIN):]
    answers = script(answer(style), (named, rest), (required, search + CALLS_END), "<｜tool▁output▁begin｜>")
    with recording_server(Tokenizer(path), answers, max_context=4096) as srv:
        srv.style, srv.named = style, named
        yield srv


def test_both_clients_get_the_reasoning_the_content_and_each_call(scripted):
    clients_get_the_calls(scripted, MSGS, TOOLS, A_TOOLS, WANT, "Checking.Done.")


def test_the_history_goes_back_in_the_format_and_forced_calls_are_prefilled(scripted):
    assert second_turn(scripted, MSGS, TOOLS) == "Sunny all three days."
    write = v31 if scripted.style == "deepseek" else fenced
    assert write("get_weather", '{"city": "Paris", "days": 3}') in scripted.prompts[-1]
    check_forced_calls(scripted, MSGS, TOOLS, "<｜Assistant｜>" + scripted.named)


# -- the grammar ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, args, wrong", HELD)
def test_calls_after_the_tag_are_held_to_their_schemas(folder, name, args, wrong):
    style, path = folder
    tokenizer = Tokenizer(path)
    write = v31 if style == "deepseek" else fenced
    text = write(name, args) + (write("search", '{"query": "x"}') + CALLS_END if wrong is None else CALLS_END)
    held_to(tokenizer, tool_grammars(tokenizer, held_prompt(style))[0], text, wrong, TAGS)


def test_forced_rests_start_where_the_prefill_ends(folder):
    style, path = folder
    tokenizer = Tokenizer(path)
    end = CALL_END if style == "deepseek" else "\n```" + CALL_END
    _, named = tool_grammars(tokenizer, held_prompt(style, "get_weather"))
    assert walk(tokenizer, named, '{"city": "Paris", "days": 1}' + end + CALLS_END)[1]
    got = allowed(tokenizer, named, '{"city": "Paris", "days": 1}' + end + CALL_BEGIN, TAGS)  # one call only
    assert got.startswith('{"city": "Paris", "days": 1}') and CALL_BEGIN not in got
    write = v31 if style == "deepseek" else fenced
    two = write("search", '{"query": "x"}') + write("search", '{"query": "y"}')
    skip = len(CALL_BEGIN) + (0 if style == "deepseek" else len("function" + SEP))
    _, required = tool_grammars(tokenizer, held_prompt(style, "required"))
    assert walk(tokenizer, required, two[skip:] + CALLS_END)[1]
    _, single = tool_grammars(tokenizer, held_prompt(style, "required", parallel=False))
    assert '"y"' not in allowed(tokenizer, single, two[skip:], TAGS)


@pytest.fixture(scope="module")
def live(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("deepseek_v3", extra_tags=TAGS, max_position_embeddings=2048)
    path = with_template(src, tmp_path_factory.mktemp("dsv3") / "m", template(False))
    with serving(path, max_context=1024) as srv:
        yield srv


@pytest.mark.parametrize("seed", range(2))
def test_a_random_deepseek_model_forced_to_call_writes_valid_calls(live, seed):
    forced_calls_are_valid(live, seed, MSGS, SCHEMAS)
