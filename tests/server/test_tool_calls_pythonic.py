"""Tool calls as Python calls, LFM2's format: ``<|tool_call_start|>[f(k="v"), g()]<|tool_call_end|>``
(both tags special tokens, which decoding would leave out). Parsed on any split (literal values
only: nothing the model writes is evaluated), a JSON list inside the block read too, through the
official OpenAI and Anthropic clients, the history rendered back by the template, named and
required calls pre-filled and held to their schemas by the grammar: hand-written calls token by
token, and a random ``lfm2_moe`` model forced to call through a live engine. The template is this
test's own, in LFM2's layout; scripted answers come from a ``ScriptedService``."""
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
from tiny_models import mark_special, with_template

from freetoken_engine.models.tokenizer import Tokenizer
from freetoken_engine.server.parser import OutputParser, Reasoning, format_tags
from freetoken_engine.server.prompt import Prompt, tool_style
from freetoken_engine.server.tool_grammar import tool_grammars

OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nList of tools: <|tool_list_start|>[{% for tool in tools %}{{ tool | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]<|tool_list_end|><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{ m.content or '' }}<|tool_call_start|>["
    "{%- for tc in m.tool_calls %}{% set f = tc.function if tc.function is defined else tc %}{{ f.name }}("
    "{%- for k, v in f.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor %})"
    "{%- if not loop.last %}, {% endif %}{%- endfor %}]<|tool_call_end|>"
    "{%- else %}{{ m.content if m.content is string else '' }}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BLOCK = OPEN + '[get_weather(city="Paris", days=3), search(query=\'rain [gear]\')]' + CLOSE
ANSWER = "<think>The user wants the forecast.</think>\n\nChecking." + BLOCK
WANT = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "rain [gear]"})]


def events(text: str, cuts: list[int]) -> list:
    p = OutputParser(tools=True, style="pythonic")
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [e for piece in pieces for e in p.feed(piece)] + p.finish()


@given(st.lists(st.integers(0, len(ANSWER)), max_size=6).map(sorted))
def test_a_block_of_calls_on_any_split_gives_each_call(cuts):
    evs = events(ANSWER, cuts)
    assert calls(evs) == WANT
    assert "".join(e.text for e in evs if isinstance(e, Reasoning)) == "The user wants the forecast."
    assert shown(evs) == "Checking."


@pytest.mark.parametrize("text, want, text_shown", [
    (OPEN + '[f(a=True, b=null, c=-1.5, d=[1, "x"], e={"k": None})]' + CLOSE + " Done.",
     [("f", {"a": True, "b": None, "c": -1.5, "d": [1, "x"], "e": {"k": None}})], "Done."),
    (OPEN + '[{"name": "search", "arguments": {"query": "x"}}]' + CLOSE, [("search", {"query": "x"})], ""),
    (OPEN + 'get_time()' + CLOSE, [("get_time", {})], ""),                      # one call, no brackets
    (OPEN + '[search(query="a"), search(query="b"', [("search", {"query": "a"}), ("search", {"query": "b"})], ""),
    (OPEN + '[__import__("os").system("rm -rf /")]' + CLOSE + "x", [],         # never evaluated: the text
     OPEN + '[__import__("os").system("rm -rf /")]' + CLOSE + "x"),
    (OPEN + '[f(a=g())]' + CLOSE, [], OPEN + '[f(a=g())]' + CLOSE),              # a value that is a call
    (OPEN + '[f(a="cut', [], OPEN + '[f(a="cut'),                                # cut inside a string
])
def test_pythonic_variants(text, want, text_shown):
    evs = events(text, [len(text) // 2])
    assert calls(evs) == want and shown(evs).strip() == text_shown


@pytest.fixture(scope="module")
def folder(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("lfm2_moe", extra_tags=(OPEN, CLOSE), max_position_embeddings=2048)
    out = with_template(src, tmp_path_factory.mktemp("lfm2") / "m", TEMPLATE)
    return mark_special(mark_special(out, OPEN), CLOSE)


def test_both_tags_are_special_yet_reach_the_parser(folder):
    tokenizer = Tokenizer(folder)
    assert tool_style(tokenizer) == "pythonic"
    ids = tokenizer.encode(BLOCK + " ok<|im_end|>", add_special_tokens=False)
    assert OPEN not in tokenizer.decode(ids)
    decoder = tokenizer.stream_decoder(format_tags("pythonic"))
    assert "".join(decoder.step(i) for i in ids) == BLOCK + " ok"


@pytest.fixture(scope="module")
def scripted(folder):
    answer = script(ANSWER, (OPEN + "[get_weather(", 'city="Rome", days=1)]' + CLOSE),
                    (OPEN + "[", 'search(query="umbrellas")]' + CLOSE), "<|im_start|>tool")
    with recording_server(Tokenizer(folder), answer, max_context=4096) as srv:
        yield srv


def test_openai_chat_gets_both_calls(scripted):
    msg, got = chat_calls(scripted, MSGS, TOOLS)
    assert msg.reasoning_content == "The user wants the forecast." and msg.content == "Checking." and got == WANT


def test_the_history_goes_back_in_the_format_and_forced_calls_are_prefilled(scripted):
    assert second_turn(scripted, MSGS, TOOLS) == "Sunny all three days."
    assert OPEN + '[get_weather(city="Paris", days=3), search(query="rain [gear]")]' + CLOSE in scripted.prompts[-1]
    check_forced_calls(scripted, MSGS, TOOLS, "<|im_start|>assistant\n" + OPEN + "[get_weather(")


def test_anthropic_gets_a_tool_use_block_per_call(scripted):
    assert tool_uses(scripted, MSGS, A_TOOLS) == WANT


# -- the grammar ------------------------------------------------------------------------------------
prompt = functools.partial(held_prompt, "pythonic")


@pytest.mark.parametrize("text, wrong", [
    ('[get_weather(city="Rome", days=3), search(query="[x]")]' + CLOSE, None),
    ('[get_weather(city="Oslo")]' + CLOSE, "Oslo"),
    ('[get_weather(days=3)]' + CLOSE, "days"),                                        # city first, required
    ('[get_weather(city="Rome", days=9)]' + CLOSE, "9"),
    ('[delete_all()]' + CLOSE, "delete"),
    ('[search()]' + CLOSE, ")]"),                                                     # query required
])
def test_calls_after_the_tag_are_held_to_their_schemas(folder, text, wrong):
    tokenizer = Tokenizer(folder)
    held_to(tokenizer, tool_grammars(tokenizer, prompt())[0], text, wrong)


@pytest.mark.parametrize("text, wrong", [
    ('[f(b="x")]' + CLOSE, None), ('[f(a=1, b="x")]' + CLOSE, None), ('[f(a=1, c=true)]' + CLOSE, None),
    ('[f()]' + CLOSE, None), ('[f(b="x", a=1)]' + CLOSE, "a=1"), ('[f(a=1, a=2)]' + CLOSE, "a=2"),
])
def test_optional_arguments_may_be_left_out_in_the_schemas_order(folder, text, wrong):
    """Each property optional: any of them, in the schema's order, each once, commas between."""
    tokenizer = Tokenizer(folder)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                               "c": {"type": "boolean"}}}
    p = Prompt(ids=[1], in_reasoning=False, prefill="", tools=True, style="pythonic", schemas={"f": schema},
               strict=frozenset({"f"}))
    held_to(tokenizer, tool_grammars(tokenizer, p)[0], text, wrong)


def test_forced_rests_start_where_the_prefill_ends(folder):
    tokenizer = Tokenizer(folder)
    _, named = tool_grammars(tokenizer, prompt("get_weather"))
    assert walk(tokenizer, named, 'city="Paris", days=1)]' + CLOSE)[1]
    got = allowed(tokenizer, named, 'city="Paris", days=1), search(query="x")]')             # one call only
    assert got.startswith('city="Paris", days=1)') and "search" not in got
    _, required = tool_grammars(tokenizer, prompt("required"))
    assert walk(tokenizer, required, 'search(query="x"), search(query="y")]' + CLOSE)[1]
    _, single = tool_grammars(tokenizer, prompt("required", parallel=False))
    assert '"y"' not in allowed(tokenizer, single, 'search(query="x"), search(query="y")]')


@pytest.mark.parametrize("seed", range(2))
def test_a_random_lfm2_model_forced_to_call_writes_valid_calls(live, seed):
    forced_calls_are_valid(live, seed, MSGS, SCHEMAS)
