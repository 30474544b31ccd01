"""ERNIE-4.5's answers (``ernie4_5_moe``, the -Thinking checkpoints): reasoning that the prompt
opened, closed by ``</think>``, then the answer between ``<response>`` tags (not shown, nor the
newlines just inside them) or Hermes JSON calls (``<tool_call>\\n{...}\\n</tool_call>``). Told apart
by a template that writes ``<response>`` or a tokenizer that has both tags as tokens. Parsed on any
split and through both official clients; a random ``ernie4_5_moe`` model forced to call writes
valid calls through a live engine. The template is this test's own, in ERNIE's layout."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from live import served_folder  # noqa: F401  (the live fixture)
from scripted import check_forced_calls, clients_get_the_calls, recording_server, script
from test_tool_calls_glm import calls
from test_tool_calls_granite import A_TOOLS, MSGS, SCHEMAS, TOOLS, events, forced_calls_are_valid, shown
from tiny_models import with_template

from freetoken_engine.models.tokenizer import Tokenizer
from freetoken_engine.server.parser import Reasoning
from freetoken_engine.server.prompt import tool_style

TEMPLATE = (
    "{%- if tools %}<|begin_of_sentence|>Tools: {% for t in tools %}{{ t | tojson }}{% endfor %}\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}User: {{ m.content }}\n"
    "{%- elif m.role == 'assistant' %}Assistant: {% if m.content %}<response>\n{{ m.content }}\n</response>{% endif %}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>\n{\"name\": {{ tc.function.name | tojson }}, \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<tool_output>{{ m.content }}</tool_output>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}Assistant: <think>\n{% endif %}")
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
         '<tool_call>\n{"name": "search", "arguments": {"query": "rain [gear]"}}\n</tool_call>')
ANSWER = "The user wants the forecast.\n</think>\n\n<response>\nChecking.\n</response>\n" + CALLS
WANT = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "rain [gear]"})]


@given(st.lists(st.integers(0, len(ANSWER)), max_size=6).map(sorted))
def test_reasoning_the_response_and_calls_on_any_split(cuts):
    evs = events(ANSWER, cuts, "ernie", in_reasoning=True)
    assert calls(evs) == WANT
    assert "".join(e.text for e in evs if isinstance(e, Reasoning)).strip() == "The user wants the forecast."
    assert shown(evs) == "Checking."


@pytest.mark.parametrize("text, want", [
    ("<response>\nParis is sunny.\n\nBring a hat.\n</response>\n", "Paris is sunny.\n\nBring a hat."),
    ("Paris is sunny.", "Paris is sunny."),                                   # no wrapper: as written
])
def test_the_wrapper_and_the_newlines_inside_it_are_not_shown(text, want):
    assert shown(events(text, [len(text) // 3], "ernie")) == want


@pytest.fixture(scope="module")
def folder(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("ernie4_5_moe", extra_tags=("<response>", "</response>"), max_position_embeddings=2048)
    return with_template(src, tmp_path_factory.mktemp("ernie") / "m", TEMPLATE)


def test_the_format_is_read_off_the_template_or_the_tokenizer(folder, tiny_checkpoint, tmp_path):
    assert tool_style(Tokenizer(folder)) == "ernie"
    tokens_only = with_template(folder, tmp_path / "t", TEMPLATE.replace("<response>", "").replace("</response>", ""))
    assert tool_style(Tokenizer(tokens_only)) == "ernie"
    assert tool_style(Tokenizer(tiny_checkpoint("qwen3_moe"))) == "json"


@pytest.fixture(scope="module")
def scripted(folder):
    named = '<tool_call>\n{"name": "get_weather", "arguments": '
    required = '<tool_call>\n{"name": "'
    answers = script(ANSWER, (named, '{"city": "Rome", "days": 1}}\n</tool_call>'),
                     (required, 'search", "arguments": {"query": "umbrellas"}}\n</tool_call>'), "<tool_output>")
    with recording_server(Tokenizer(folder), answers, max_context=4096) as srv:
        yield srv


def test_both_clients_get_the_reasoning_the_content_and_each_call(scripted):
    """The reasoning keeps the newline before ``</think>``, as every ``<think>`` format's does."""
    clients_get_the_calls(scripted, MSGS, TOOLS, A_TOOLS, WANT, "Checking.", reasoning="The user wants the forecast.\n")


def test_forced_calls_close_the_reasoning_and_are_prefilled(scripted):
    check_forced_calls(scripted, MSGS, TOOLS, '<think>\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ')


@pytest.mark.parametrize("seed", range(2))
def test_a_random_ernie_model_forced_to_call_writes_valid_calls(live, seed):
    forced_calls_are_valid(live, seed, MSGS, SCHEMAS)
