"""Tool calls in Kimi-K2's tokens: ``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>
{...}<|tool_call_end|>`` inside ``<|tool_calls_section_begin|>`` / ``<|tool_calls_section_end|>``, every
tag a special token of Moonshot's tiktoken tokenizer. Parsed on any split, arguments streamed,
through the official OpenAI and Anthropic clients; the history goes back with each call's id as
the model wrote it (``functions.NAME:INDEX``, whatever id the API gave it) and its result under
that id; named and required calls pre-filled and held to their schemas by the grammar; a random
``kimi_k2`` model (latent attention, tiktoken tokenizer) forced to call through a live engine.
The template is this test's own, in Kimi-K2's layout (``kimi_models.TEMPLATE``)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kimi_models import TOOL_TAGS, VOCAB, kimi_folder
from live import served_folder  # noqa: F401  (the live fixture)
from scripted import check_forced_calls, clients_get_the_calls, format_server, script, second_turn
from test_tool_calls_glm import calls
from test_tool_calls_granite import (A_TOOLS, HELD, MSGS, SCHEMAS, TOOLS, allowed, events, forced_calls_are_valid,
                                     halved_calls, held_prompt, held_to, shown, walk)

from freetoken_engine.models.tokenizer import Tokenizer
from freetoken_engine.server.parser import OutputParser, Reasoning, ToolArgs, ToolEnd, ToolStart, format_tags
from freetoken_engine.server.parser_deepseek import (KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_CALLS_BEGIN, KIMI_CALLS_END,
                                                     KIMI_SEP, kimi_name)
from freetoken_engine.server.prompt import build_prompt, tool_style
from freetoken_engine.server.tool_grammar import tool_grammars

STYLE = "kimi"


def call(name: str, args: str, index: int = 0, prefix: str = "functions.") -> str:
    return f"{KIMI_CALL_BEGIN}{prefix}{name}:{index}{KIMI_SEP}{args}{KIMI_CALL_END}"


ARGS = ('{"city": "Paris", "days": 3}', '{"query": "rain <|tool_call_end|> [gear]"}')
WANT = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "rain <|tool_call_end|> [gear]"})]
BLOCK = KIMI_CALLS_BEGIN + call("get_weather", ARGS[0]) + call("search", ARGS[1], 1) + KIMI_CALLS_END
ANSWER = "<think>The user wants the forecast.</think>\n\nChecking." + BLOCK + " Done."


@given(cuts=st.lists(st.integers(0, len(ANSWER)), max_size=6).map(sorted))
def test_a_section_of_calls_on_any_split_gives_each_call(cuts):
    """A closing tag inside a JSON string is the argument's text, not the call's end."""
    evs = events(ANSWER, cuts, STYLE)
    assert calls(evs) == WANT
    assert "".join(e.text for e in evs if isinstance(e, Reasoning)) == "The user wants the forecast."
    assert shown(evs) == "Checking.Done."


@pytest.mark.parametrize("call_id, name", [("functions.get_weather:0", "get_weather"), ("get_weather:3", "get_weather"),
                                           ("functions.mcp.fs.read:12", "mcp.fs.read"), ("functions.f", "f"),
                                           ("functions.a:b", "a:b")])
def test_the_name_is_read_off_the_calls_id(call_id, name):
    assert kimi_name(call_id) == name


@pytest.mark.parametrize("text, want, text_shown", [
    (KIMI_CALLS_BEGIN + call("get_time", "{}") + KIMI_CALLS_END, [("get_time", {})], ""),
    (KIMI_CALLS_BEGIN + call("get_time", "") + KIMI_CALLS_END, [("get_time", {})], ""),     # no arguments written
    (KIMI_CALLS_BEGIN + "\n" + call("f", '{"a": [1, {"b": null}]}') + "\n" + call("g", "{}", 1, "") + "\n"
     + KIMI_CALLS_END + "x", [("f", {"a": [1, {"b": None}]}), ("g", {})], "x"),
    (KIMI_CALLS_BEGIN + KIMI_CALL_BEGIN + "functions.search:0" + KIMI_SEP + '{"query": "cut', [("search", None)], ""),
    (KIMI_CALLS_BEGIN + "not a call" + KIMI_CALLS_END, [], KIMI_CALLS_BEGIN + "not a call" + KIMI_CALLS_END),
    (KIMI_CALLS_BEGIN + call("f", "{}") + "oops", [("f", {})], "oops"),                        # text after a call
    (KIMI_CALLS_BEGIN + KIMI_CALL_BEGIN + "functions.f:0" + KIMI_CALL_END, [],                  # no separator
     KIMI_CALLS_BEGIN + KIMI_CALL_BEGIN + "functions.f:0" + KIMI_CALL_END),
    (KIMI_CALLS_BEGIN + KIMI_CALL_BEGIN + KIMI_SEP + "{}" + KIMI_CALL_END, [],                   # no id, no name
     KIMI_CALLS_BEGIN + KIMI_CALL_BEGIN + KIMI_SEP + "{}" + KIMI_CALL_END),
])
def test_kimi_variants(text, want, text_shown):
    evs = halved_calls(text, want, STYLE)
    assert shown(evs).strip() == text_shown


def test_a_calls_id_starts_it_and_its_arguments_stream():
    p = OutputParser(tools=True, style=STYLE)
    assert p.feed(KIMI_CALLS_BEGIN + KIMI_CALL_BEGIN + "functions.get_weather:0") == []
    started = p.feed(KIMI_SEP + '{"city": ')
    assert [type(e) for e in started] == [ToolStart, ToolArgs] and started[0].name == "get_weather"
    assert [e.text for e in p.feed('"Paris"')] == ['"Paris"']
    assert [type(e) for e in p.feed("}" + KIMI_CALL_END + KIMI_CALLS_END)] == [ToolArgs, ToolEnd]


@pytest.fixture(scope="module")
def folder(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("deepseek_v3", vocab_size=VOCAB, max_position_embeddings=2048)
    return kimi_folder(src, tmp_path_factory.mktemp("kimi") / "m")


def test_the_templates_format_is_read_and_its_special_tags_reach_the_parser(folder):
    tokenizer = Tokenizer(folder)
    assert tool_style(tokenizer) == STYLE
    ids = tokenizer.encode(BLOCK + " ok<|im_end|>", add_special_tokens=False)
    assert KIMI_CALLS_BEGIN not in tokenizer.decode(ids)
    decoder = tokenizer.stream_decoder(format_tags(STYLE))
    assert "".join(decoder.step(i) for i in ids) == BLOCK + " ok"


def test_the_history_carries_the_ids_kimi_writes_whatever_the_api_called_them(folder):
    """Calls named ``call_...`` by the API go back as ``functions.NAME:INDEX``, each result under
    its call's (one sent without an id answers the next call), as the model wrote and reads them."""
    calls_ = [{"id": "call_A", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
              {"id": "toolu_B", "type": "function", "function": {"name": "search", "arguments": {"query": "x"}}}]
    msgs = [*MSGS, {"role": "assistant", "content": "", "tool_calls": calls_},
            {"role": "tool", "tool_call_id": "toolu_B", "content": "found"},
            {"role": "tool", "content": "cold"}]
    tokenizer = Tokenizer(folder)
    text = tokenizer.decode(build_prompt(tokenizer, msgs, TOOLS).ids, skip_special_tokens=False)
    assert call("get_weather", '{"city": "Oslo"}') + call("search", '{"query": "x"}', 1) in text
    assert "## Return of functions.search:1\nfound" in text and "## Return of functions.get_weather:0\ncold" in text
    assert "call_A" not in text and "toolu_B" not in text
    assert '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather"' in text


@pytest.fixture(scope="module")
def scripted(folder):
    named = KIMI_CALLS_BEGIN + KIMI_CALL_BEGIN + "functions.get_weather:0" + KIMI_SEP
    required = KIMI_CALLS_BEGIN + KIMI_CALL_BEGIN + "functions."
    rest = '{"city": "Rome", "days": 1}' + KIMI_CALL_END + KIMI_CALLS_END
    search = call("search", '{"query": "umbrellas"}')[len(KIMI_CALL_BEGIN + "functions."):] + KIMI_CALLS_END
    with format_server(folder, named, script(ANSWER, (named, rest), (required, search), "## Return of")) as srv:
        yield srv


def test_both_clients_get_the_reasoning_the_content_and_each_call(scripted):
    clients_get_the_calls(scripted, MSGS, TOOLS, A_TOOLS, WANT, "Checking.Done.")


def test_the_history_goes_back_in_the_format_and_forced_calls_are_prefilled(scripted):
    assert second_turn(scripted, MSGS, TOOLS) == "Sunny all three days."
    assert call("get_weather", '{"city": "Paris", "days": 3}') in scripted.prompts[-1]
    assert "<|im_system|>tool<|im_middle|>## Return of functions.search:1\nok<|im_end|>" in scripted.prompts[-1]
    check_forced_calls(scripted, MSGS, TOOLS, "<|im_assistant|>assistant<|im_middle|>" + scripted.named)


# -- the grammar ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, args, wrong", HELD)
def test_calls_after_the_tag_are_held_to_their_schemas(folder, name, args, wrong):
    tokenizer = Tokenizer(folder)
    text = call(name, args) + (call("search", '{"query": "x"}', 1) + KIMI_CALLS_END if wrong is None else KIMI_CALLS_END)
    held_to(tokenizer, tool_grammars(tokenizer, held_prompt(STYLE))[0], text, wrong, TOOL_TAGS)


def test_forced_rests_start_where_the_prefill_ends(folder):
    tokenizer = Tokenizer(folder)
    _, named = tool_grammars(tokenizer, held_prompt(STYLE, "get_weather"))
    assert walk(tokenizer, named, '{"city": "Paris", "days": 1}' + KIMI_CALL_END + KIMI_CALLS_END)[1]
    got = allowed(tokenizer, named, '{"city": "Paris", "days": 1}' + KIMI_CALL_END + KIMI_CALL_BEGIN, TOOL_TAGS)
    assert got.startswith('{"city": "Paris", "days": 1}') and KIMI_CALL_BEGIN not in got      # one call only
    two = call("search", '{"query": "x"}') + call("search", '{"query": "y"}', 1)
    skip = len(KIMI_CALL_BEGIN + "functions.")
    _, required = tool_grammars(tokenizer, held_prompt(STYLE, "required"))
    assert walk(tokenizer, required, two[skip:] + KIMI_CALLS_END)[1]
    _, single = tool_grammars(tokenizer, held_prompt(STYLE, "required", parallel=False))
    assert '"y"' not in allowed(tokenizer, single, two[skip:], TOOL_TAGS)


@pytest.mark.parametrize("seed", range(2))
def test_a_random_kimi_model_forced_to_call_writes_valid_calls(live, seed):
    forced_calls_are_valid(live, seed, MSGS, SCHEMAS)
