"""gpt-oss's answers in OpenAI's harmony format (``style="harmony"``): messages on channels,
reasoning on ``analysis``, the answer on ``final``, a preamble on ``commentary``, each call a
``commentary`` message to ``functions.NAME`` whose body is its JSON arguments. The tags are special
tokens, kept for the parser with or without tools. Reasoning, content and calls split on any split,
arguments streamed, through both official clients; forced calls pre-filled; the reasoning goes back
to the template as ``thinking``. The template is this test's own, in gpt-oss's layout."""
from __future__ import annotations

import json

import jsonschema

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from format_cases import answered_without_tools, format_folder, special_tags_reach_the_parser
from live import served_folder  # noqa: F401  (the live fixture)
from scripted import check_forced_calls, clients_get_the_calls, format_server, script, second_turn
from test_tool_calls_glm import calls
from test_tool_calls_granite import (A_TOOLS, HELD, MSGS, SCHEMAS, TOOLS, allowed, events, forced_calls_are_valid,
                                     held_prompt, shown, thought, walk)

from freetoken_engine.executor.guide import Guide
from freetoken_engine.models.tokenizer import Tokenizer
from freetoken_engine.server.parser import ToolArgs, ToolEnd, ToolStart, output_parser
from freetoken_engine.server.parser_harmony import TAGS
from freetoken_engine.server.prompt import build_prompt
from freetoken_engine.server.structured import guide_spec
from freetoken_engine.server.tool_grammar import tool_grammars

STYLE = "harmony"
TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|end|>"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role in ('system', 'user') %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' %}"
    "{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "{%- if m.tool_calls %}{% for tc in m.tool_calls %}<|start|>assistant to=functions.{{ tc.function.name }}"
    "<|channel|>commentary json<|message|>{{ tc.function.arguments | tojson }}<|call|>{% endfor %}"
    "{%- else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}"
    "{%- elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")
TURN = "<|start|>assistant"
REASONING = "<|channel|>analysis<|message|>The user wants the forecast.<|end|>"
PREAMBLE = f"{TURN}<|channel|>commentary<|message|>Checking.<|end|>"


def call(name: str, args: str, head_recipient: bool = False) -> str:
    """A call as gpt-oss writes it: the recipient in the channel part, or after the role."""
    if head_recipient:
        return f"{TURN} to=functions.{name}<|channel|>commentary json<|message|>{args}<|call|>"
    return f"{TURN}<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}<|call|>"


ARGS = ('{"city": "Paris", "days": 3}', '{"query": "rain [gear] in <|channel|"}')
WANT = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "rain [gear] in <|channel|"})]
ANSWER = REASONING + PREAMBLE + call("get_weather", ARGS[0]) + call("search", ARGS[1], head_recipient=True)


@given(cuts=st.lists(st.integers(0, len(ANSWER)), max_size=6).map(sorted))
def test_reasoning_preamble_and_calls_on_any_split(cuts):
    """The recipient in either place; a tag's first characters inside the arguments held back
    only until they are decided."""
    evs = events(ANSWER, cuts, STYLE)
    assert calls(evs) == WANT
    assert thought(evs) == "The user wants the forecast."
    assert shown(evs) == "Checking."


@pytest.mark.parametrize("text, want, text_shown, reasoning", [
    (f"{REASONING}{TURN}<|channel|>final<|message|>Seoul.<|return|>", [], "Seoul.", "The user wants the forecast."),
    ("<|channel|>final<|message|>Seoul.", [], "Seoul.", ""),                       # <|return|> is EOS: not in the text
    (call("get_time", "{}")[len(TURN):], [("get_time", {})], "", ""),              # the first header has no <|start|>
    (call("get_time", "")[:-len("<|call|>")], [("get_time", {})], "", ""),         # no arguments, <|call|> as EOS
    (call("browser.search", '{"q": "x"}', head_recipient=True).replace("functions.", ""),
     [("browser.search", {"q": "x"})], "", ""),                                    # a built-in tool, named as written
    ("Plain words, no header.", [], "Plain words, no header.", ""),                # a model that writes no format
    ("<|channel|>analysis<|message|>Thinking cut by max_tok", [], "", "Thinking cut by max_tok"),
    ("<|channel|>analy", [], "", ""),                                              # a header cut: format, dropped
])
def test_harmony_variants(text, want, text_shown, reasoning):
    evs = events(text, [len(text) // 2], STYLE)
    assert calls(evs) == want
    assert shown(evs) == text_shown and thought(evs) == reasoning


def test_a_calls_name_starts_it_and_its_arguments_stream_and_without_tools_it_is_text():
    p = output_parser(tools=True, style=STYLE)
    assert p.feed(f"{TURN}<|channel|>commentary to=functions.get_weather <|constrain|>json") == []
    started = p.feed('<|message|>{"city": ')
    assert [type(e) for e in started] == [ToolStart, ToolArgs] and started[0].name == "get_weather"
    assert [e.text for e in p.feed('"Paris"')] == ['"Paris"']
    assert [type(e) for e in p.feed("}<|call|>")] == [ToolArgs, ToolEnd]
    evs = events(call("get_weather", ARGS[0]), [7], STYLE, tools=False)
    assert shown(evs) == ARGS[0] and not calls(evs)


@pytest.fixture(scope="module")
def folder(tiny_checkpoint, tmp_path_factory):
    return format_folder(tiny_checkpoint, tmp_path_factory, "gpt_oss", TEMPLATE, TAGS)


def test_the_templates_format_is_read_and_its_special_tags_reach_the_parser(folder):
    """The tags are special tokens (decoding leaves them out); the stream decoder keeps them for
    this format, with or without tools: they are what tells reasoning from the answer."""
    special_tags_reach_the_parser(folder, STYLE, ANSWER, "<|channel|>")


def test_forced_calls_are_prefilled_and_the_reasoning_goes_back_as_thinking(folder):
    tokenizer = Tokenizer(folder)
    p = build_prompt(tokenizer, MSGS, TOOLS, tool_choice="required")
    assert p.prefill == "<|channel|>commentary to=functions." and not p.in_reasoning
    p = build_prompt(tokenizer, MSGS, TOOLS, named_tool="search")
    assert p.prefill == "<|channel|>commentary to=functions.search <|constrain|>json<|message|>"
    history = [*MSGS, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."},
               {"role": "user", "content": "Thanks"}]
    text = tokenizer.decode(build_prompt(tokenizer, history, None).ids, skip_special_tokens=False)
    assert "<|channel|>analysis<|message|>Look it up.<|end|>" in text


@pytest.fixture(scope="module")
def scripted(folder):
    named = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    required = "<|channel|>commentary to=functions."
    with_tools = script(ANSWER, (named, '{"city": "Rome", "days": 1}<|call|>'),
                        (required, 'search <|constrain|>json<|message|>{"query": "umbrellas"}<|call|>'),
                        "to=assistant", reply="<|channel|>final<|message|>Sunny all three days.<|return|>")
    bye = f"{REASONING}{TURN}<|channel|>final<|message|>Bye!"
    with format_server(folder, named, with_tools, "# Tools", bye) as srv:
        yield srv


def test_both_clients_get_the_reasoning_the_content_and_each_call(scripted):
    clients_get_the_calls(scripted, MSGS, TOOLS, A_TOOLS, WANT, "Checking.")


def test_the_history_goes_back_in_the_format_and_forced_calls_are_prefilled(scripted):
    assert second_turn(scripted, MSGS, TOOLS) == "Sunny all three days."
    back = scripted.prompts[-1]
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>' in back
    assert json.dumps({"city": "Paris", "days": 3}) in back
    check_forced_calls(scripted, MSGS, TOOLS, scripted.named)


def test_without_tools_the_answer_is_split_from_the_reasoning(scripted):
    assert answered_without_tools(scripted) == ("The user wants the forecast.", "Bye!")
    m = scripted.anthropic().messages.create(model=scripted.model, max_tokens=100, messages=[
        {"role": "user", "content": "Thanks, that is all."}])
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", "The user wants the forecast."), ("text", "Bye!")]


def test_the_reasoning_effort_reaches_the_template(scripted):
    """OpenAI's ``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses), and Anthropic's
    thinking budget, become the template's ``reasoning_effort``: gpt-oss's system message says it."""
    client = scripted.openai()
    client.chat.completions.create(model=scripted.model, messages=MSGS, reasoning_effort="high")
    assert "Reasoning: high<|end|>" in scripted.prompts[-1]
    client.responses.create(model=scripted.model, input="Hi", reasoning={"effort": "low"})
    assert "Reasoning: low<|end|>" in scripted.prompts[-1]
    client.chat.completions.create(model=scripted.model, messages=MSGS)
    assert "Reasoning: medium<|end|>" in scripted.prompts[-1]
    # Anthropic's thinking budget: under 4,096 tokens low, under 16,384 medium, else high
    for budget, effort in ((1024, "low"), (8000, "medium"), (20000, "high")):
        scripted.anthropic().messages.create(model=scripted.model, max_tokens=30000, messages=MSGS,
                                             thinking={"type": "enabled", "budget_tokens": budget})
        assert f"Reasoning: {effort}<|end|>" in scripted.prompts[-1]


# -- the grammar ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, args, wrong", HELD)
def test_forced_calls_are_held_to_their_schemas(folder, name, args, wrong):
    """A forced call's rest after its pre-fill (required: from the tool's name; named: from its
    arguments), ``<|call|>`` ending it; a call the model opens itself is not held (``<|channel|>``
    opens every message), nor is an answer's grammar escaped by it."""
    tokenizer = Tokenizer(folder)
    _, named = tool_grammars(tokenizer, held_prompt(STYLE, name if name in SCHEMAS else "search"))
    _, required = tool_grammars(tokenizer, held_prompt(STYLE, "required"))
    rest = f"{name} <|constrain|>json<|message|>{args}<|call|>"
    n, complete = walk(tokenizer, required, rest)
    if wrong is None:
        assert complete and walk(tokenizer, named, args + "<|call|>")[1]
        assert not walk(tokenizer, named, args + "<|end|>")[1]
    else:
        assert not complete and len(allowed(tokenizer, required, rest, TAGS)) < rest.index(wrong) + len(wrong)
    assert guide_spec(None, tokenizer, build_prompt(tokenizer, MSGS, TOOLS)) is None       # auto, nothing strict
    spec = guide_spec('start: "ok"', tokenizer, build_prompt(tokenizer, MSGS, strict_tools()))
    assert spec.escape == () and spec.tool_grammar is None        # an answer's grammar is not escaped


def strict_tools(*names: str) -> list[dict]:
    """TOOLS with ``strict`` set on ``names`` (all of them by default)."""
    return [{"type": "function", "function": {**t["function"], "strict": t["function"]["name"] in names or not names}}
            for t in TOOLS]


def guided(tokenizer, spec, text: str) -> tuple[str, str]:
    """Feed ``text`` under the guide of ``spec``: (what the masks let through, the guide's state)."""
    g = Guide(spec, tokenizer, tokenizer.vocab_size)
    ids = tokenizer.encode(text, add_special_tokens=False)
    for n, t in enumerate(ids):
        if not torch.isfinite(g.constrain(torch.zeros(tokenizer.vocab_size))[t]):
            break
        g.advance(t)
    else:
        n = len(ids)
    decoder = tokenizer.stream_decoder(TAGS)
    return "".join(decoder.step(i) for i in ids[:n]), g.state


FINAL = f"{TURN}<|channel|>final<|message|>Sunny, <b>3</b> days.<|return|>"


@pytest.mark.parametrize("text, wrong", [
    (ANSWER, None),                                              # reasoning, a preamble, both call forms
    (REASONING + FINAL, None),                                   # no call: the answer, free
    (call("get_weather", '{"city": "Oslo", "days": 3}'), "Oslo"),
    (REASONING + call("get_weather", '{"city": "Rome", "days": 9}', head_recipient=True), "9"),
    (call("delete_all", "{}"), "delete"),                       # not a tool
    (call("search", "{}", head_recipient=True), "{}"),          # query required
    (call("search", '{"query": "x"}') + FINAL, None),
])
def test_strict_tools_hold_the_calls_the_model_opens_itself(folder, text, wrong):
    """``strict`` tools on ``auto``: after ``<|channel|>`` or ``<|start|>`` the grammar holds the
    whole message, so a call the model opens itself (the recipient after the channel or after the
    role) names a tool and its arguments satisfy the schema, while reasoning, preambles and the
    answer stay free text to their end tags; between messages the output is free again."""
    tokenizer = Tokenizer(folder)
    spec = guide_spec(None, tokenizer, build_prompt(tokenizer, MSGS, strict_tools()))
    assert {tokenizer.decode([t], skip_special_tokens=False) for t in spec.escape} == {"<|start|>", "<|channel|>"}
    through, state = guided(tokenizer, spec, text)
    if wrong is None:
        assert through == text and state == "text"
    else:
        assert state == "tool" and text.index(wrong) - 4 <= len(through) <= text.index(wrong)


def test_a_tool_that_is_not_strict_keeps_free_arguments_among_strict_ones(folder):
    tokenizer = Tokenizer(folder)
    spec = guide_spec(None, tokenizer, build_prompt(tokenizer, MSGS, strict_tools("get_weather")))
    loose = call("search", '{"anything": [1, 2]}', head_recipient=True)
    assert guided(tokenizer, spec, loose) == (loose, "text")
    wrong = call("get_weather", '{"city": "Oslo", "days": 3}')
    assert guided(tokenizer, spec, wrong)[1] == "tool"


@pytest.mark.parametrize("seed", range(2))
def test_a_random_gpt_oss_model_forced_to_call_writes_valid_calls(live, seed):
    forced_calls_are_valid(live, seed, MSGS, SCHEMAS)


def test_a_random_gpt_oss_model_calling_strict_tools_on_its_own_writes_valid_calls(live, folder):
    """``auto`` with strict tools through the live server and the official client: a random model
    pushed (logit_bias) to open a message, head for a call and close strings, objects and the call
    writes calls that name a tool and satisfy its schema, in every seed (this tiny folder's stop
    token is not ``<|call|>``: it keeps calling, and a last call cut by max_tokens is left out)."""
    tokenizer = Tokenizer(folder)
    push = {tokenizer.token_to_id("<|channel|>"): 100}
    for word in ("commentary to", '"}', "<|call|>"):
        push.update({t: 30 for t in tokenizer.encode(word, add_special_tokens=False)})
    client = live.openai()
    for seed in range(3):
        r = client.chat.completions.create(model=live.model, messages=MSGS, tools=strict_tools(), max_tokens=200,
                                           temperature=1.0, seed=seed, logit_bias={str(t): b for t, b in push.items()})
        got = r.choices[0].message.tool_calls or []
        whole = got[:-1] if r.choices[0].finish_reason == "length" else got    # the last may be cut by max_tokens
        assert whole, r.choices[0]
        for c in whole:
            jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
