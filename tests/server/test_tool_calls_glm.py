"""Tool calls in GLM-4.5/4.6/4.7's format (``<tool_call>NAME`` then ``<arg_key>K</arg_key>
<arg_value>V</arg_value>`` pairs): parsed on any split into typed JSON arguments (GLM-4.7's form
without newlines too), held to their schemas token by token with the tags as the tokens they are
in GLM's tokenizer, rendered back into the history in the format, pre-filled for tool_choice,
and, end to end, a random glm4_moe model forced to call writes calls that satisfy their schemas.
The template is this test's own, in the format GLM-4.5 publishes (``<|assistant|>`` then the
model's own ``<think>``); scripted answers come from a ``ScriptedService``."""
from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st
from live import API_KEY, live_server, start_service
from scripted import answered, recording_server
from test_tool_grammar import SCHEMAS, allowed, walk
from tiny_models import with_template

from freetoken_engine.executor.guide import Guide, GuideSpec
from freetoken_engine.models.tokenizer import Tokenizer
from freetoken_engine.server.parser import GLM_TAGS, OutputParser, Reasoning, ToolArgs, ToolEnd, ToolStart
from freetoken_engine.server.prompt import Prompt, tool_style
from freetoken_engine.server.tool_grammar import tool_grammars

TEMPLATE = (
    "[gMASK]<sop>{%- if tools %}<|system|>\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools>\nCall a tool as <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>\n<think></think>{% if m.content %}\n{{ m.content }}{% endif %}"
    "{%- for tc in m.tool_calls or [] %}{%- set f = tc.function if tc.function is defined else tc %}"
    "{{ '\\n<tool_call>' + f.name + '\\n' }}"
    "{%- for k, v in f.arguments.items() %}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v | tojson if v is not string else v }}</arg_value>\n{% endfor %}</tool_call>{%- endfor %}"
    "{%- elif m.role == 'tool' %}<|observation|>\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- else %}<|{{ m.role }}|>\n{{ m.content if m.content is string else '' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")
CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
ANSWER = "\n<think>The user wants the forecast.</think>\nChecking.\n" + CALL
ARGS = {"city": "Paris", "days": 3}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
A_TOOLS = [{"name": "get_weather", "description": "forecast", "input_schema": TOOLS[0]["function"]["parameters"]}]
MSGS = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
NAMED_REST = "<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n<arg_key>days</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"


def events(text: str, cuts: list[int], schemas=None) -> list:
    p = OutputParser(tools=True, style="glm", schemas=schemas or {"get_weather": TOOLS[0]["function"]["parameters"]})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [e for piece in pieces for e in p.feed(piece)] + p.finish()


def calls(evs: list) -> list[tuple[str, object]]:
    names = {e.index: e.name for e in evs if isinstance(e, ToolStart)}
    args = {}
    for e in evs:
        if isinstance(e, ToolArgs):
            args[e.index] = args.get(e.index, "") + e.text
    assert sorted(names) == sorted(e.index for e in evs if isinstance(e, ToolEnd))
    return [(names[i], json.loads(args[i])) for i in sorted(names)]


@given(st.lists(st.integers(0, len(ANSWER)), max_size=6).map(sorted))
def test_glm_calls_on_any_split_give_typed_arguments(cuts):
    evs = events(ANSWER, cuts)
    assert calls(evs) == [("get_weather", ARGS)]
    assert "".join(e.text for e in evs if isinstance(e, Reasoning)) == "The user wants the forecast."
    shown = "".join(e.text for e in evs if type(e).__name__ == "Content")
    assert shown.strip() == "Checking." and "<" not in shown


@pytest.mark.parametrize("text, want", [
    # GLM-4.7: no newlines between the tags; two calls; a value holding another tag
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value><arg_key>days</arg_key>"
     "<arg_value>2</arg_value></tool_call><tool_call>search<arg_key>query</arg_key>"
     "<arg_value>a <arg_key> in text</arg_value></tool_call>",
     [("get_weather", {"city": "Rome", "days": 2}), ("search", {"query": "a <arg_key> in text"})]),
    ("<tool_call>get_weather\n</tool_call>", [("get_weather", {})]),                     # no arguments
    ('<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>',       # a Hermes body
     [("search", {"query": "x"})]),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lyon",                 # cut by max_tokens
     [("get_weather", {"city": "Lyon"})]),
])
def test_glm_variants_parse(text, want):
    assert calls(events(text, [len(text) // 3])) == want


@pytest.fixture(scope="module")
def glm_dir(tiny_checkpoint, tmp_path_factory):
    """A random glm4_moe model whose tokenizer has GLM's tags as tokens, with the GLM template;
    a longer context leaves room for the tools' prompt."""
    return with_template(tiny_checkpoint("glm4_moe", extra_tags=GLM_TAGS, max_position_embeddings=2048),
                         tmp_path_factory.mktemp("glm") / "m", TEMPLATE)


@pytest.fixture(scope="module")
def glm_tok(glm_dir):
    tokenizer = Tokenizer(glm_dir)
    assert tool_style(tokenizer) == "glm" and all(tokenizer.token_to_id(t) is not None for t in GLM_TAGS)
    return tokenizer, 320, tokenizer.token_to_id("</tool_call>")


def prompt(forced: str | None = None, parallel: bool = True) -> Prompt:
    return Prompt(ids=[1], in_reasoning=False, prefill="x" if forced else "", tools=True, style="glm",
                  schemas=SCHEMAS, strict=frozenset(SCHEMAS), forced=forced, parallel=parallel)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", [
    "get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
    "<arg_key>note</arg_key>\n<arg_value>any text\nover lines</arg_value>\n",
    "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>7</arg_value>",
    "search\n<arg_key>query</arg_key>\n<arg_value>what is <b>bold</b>?</arg_value>\n",
])
def test_right_glm_calls_are_allowed_token_by_token(glm_tok, text):
    tokenizer, vocab, close = glm_tok
    assert tokenizer.token_to_id("<arg_key>") in ids_of(tokenizer, text)      # the tags are single tokens
    after_open, _ = tool_grammars(tokenizer, prompt())
    n, complete = walk(tokenizer, vocab, after_open, text, close)
    assert complete and n == len(ids_of(tokenizer, text)) + 1


@pytest.mark.parametrize("text, wrong", [
    ("get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n", "Oslo"),
    ("get_weather\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n", "days"),            # city first
    ("get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>9</arg_value>\n", "9"),
    ("delete_all\n", "delete"),
])
def test_wrong_glm_calls_are_cut_where_they_go_wrong(glm_tok, text, wrong):
    tokenizer, vocab, close = glm_tok
    after_open, _ = tool_grammars(tokenizer, prompt())
    n, complete = walk(tokenizer, vocab, after_open, text, close)
    at = text.index(wrong)
    assert not complete and at - 4 <= len(tokenizer.decode(ids_of(tokenizer, text)[:n])) < at + len(wrong)


def test_forced_glm_answers_are_calls_then_the_end(glm_tok):
    tokenizer, vocab, close = glm_tok
    _, named = tool_grammars(tokenizer, prompt("get_weather"))
    assert walk(tokenizer, vocab, named, NAMED_REST.replace("</tool_call>", ""), close)[1]
    _, required = tool_grammars(tokenizer, prompt("required"))
    g = Guide(GuideSpec(None, in_tool=required), tokenizer, vocab)
    first = "search\n<arg_key>query</arg_key>\n<arg_value>x</arg_value>\n"
    assert walk(tokenizer, vocab, required, first, close, g)[1]
    after, open_ = allowed(g, vocab), tokenizer.token_to_id("<tool_call>")
    assert open_ in after and not after & set(ids_of(tokenizer, "Hello"))     # another call or the end
    assert not g.advance(open_)
    assert walk(tokenizer, vocab, None, "get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value>"
                                        "<arg_key>days</arg_key><arg_value>2</arg_value>", close, g)[1]


@pytest.fixture(scope="module")
def scripted(glm_dir):
    def answer(prompt: str) -> str:
        if prompt.endswith("<tool_call>get_weather\n"):
            return NAMED_REST
        return "\n<think>Sunny.</think>\nSunny all three days." if "<tool_response>" in prompt else ANSWER
    with recording_server(Tokenizer(glm_dir), answer) as srv:
        yield srv


def test_openai_chat_gets_the_glm_call_as_typed_json_arguments(scripted):
    r = scripted.openai().chat.completions.create(model=scripted.model, messages=MSGS, tools=TOOLS)
    msg = r.choices[0].message
    assert msg.reasoning_content == "The user wants the forecast."
    assert msg.content.strip() == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("get_weather", ARGS)]
    assert r.choices[0].finish_reason == "tool_calls"


def test_openai_stream_gives_the_arguments_a_parameter_at_a_time(scripted):
    chunks = list(scripted.openai().chat.completions.create(model=scripted.model, messages=MSGS, tools=TOOLS,
                                                            stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name == "get_weather"
    fragments = [tc.function.arguments for tc in deltas if tc.function.arguments]
    assert len(fragments) == 3 and json.loads("".join(fragments)) == ARGS
    assert not any("<" in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_the_history_goes_back_in_glm_format_and_named_calls_are_prefilled(scripted):
    client = scripted.openai()
    first = client.chat.completions.create(model=scripted.model, messages=MSGS, tools=TOOLS).choices[0].message
    r = client.chat.completions.create(model=scripted.model, messages=answered(MSGS, first, "sunny"), tools=TOOLS)
    assert r.choices[0].message.content == "Sunny all three days."
    assert ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>") in scripted.prompts[-1]
    r = client.chat.completions.create(model=scripted.model, messages=MSGS, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert scripted.prompts[-1].endswith("<|assistant|><tool_call>get_weather\n")
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Rome", "days": 1}


def test_anthropic_tool_use_block_from_a_glm_call(scripted):
    m = scripted.anthropic().messages.create(model=scripted.model, max_tokens=200, messages=MSGS, tools=A_TOOLS)
    assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == [("get_weather", ARGS)]
    assert m.stop_reason == "tool_use"


ENUMS = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
         "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}


def test_a_random_glm4_moe_model_forced_to_call_writes_valid_calls(glm_dir):
    """The whole path on the new family: the glm4_moe engine, GLM's template and tags, the
    grammar and the parser. Forced calls (required, and named) always parse and satisfy their
    schemas, and a forced answer ends at its call."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": ENUMS}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    svc = start_service(glm_dir, max_context=1024)
    try:
        with live_server(svc, api_key=API_KEY) as srv:
            client = srv.openai()
            for seed in range(2):
                for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
                    r = client.chat.completions.create(model=srv.model, messages=MSGS, tools=tools, tool_choice=choice,
                                                       max_tokens=120, temperature=1.0, seed=seed,
                                                       parallel_tool_calls=False)
                    msg = r.choices[0].message
                    assert len(msg.tool_calls) == 1 and r.choices[0].finish_reason == "tool_calls", r.choices[0]
                    c = msg.tool_calls[0]
                    jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
                    if isinstance(choice, dict):
                        assert c.function.name == "get_time"
    finally:
        svc.shutdown()


def test_a_named_call_is_prefilled_as_the_template_writes_a_call(glm_dir, tmp_path):
    """GLM-4.5's template puts a newline between a call's name and its first <arg_key>, GLM-4.7's
    none: the named pre-fill follows the model's own template."""
    from freetoken_engine.server.prompt import build_prompt, glm_after_name
    glm47 = tmp_path / "glm47"
    shutil.copytree(glm_dir, glm47)
    config = json.loads((glm47 / "tokenizer_config.json").read_text())
    template = TEMPLATE.replace("{{ '\\n<tool_call>' + f.name + '\\n' }}", "{{ '<tool_call>' + f.name }}")
    template = template.replace("</arg_key>\n<arg_value>", "</arg_key><arg_value>")
    assert template != TEMPLATE
    (glm47 / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=template)))
    for folder, gap in ((glm_dir, "\n"), (glm47, "")):
        tokenizer = Tokenizer(folder)
        assert glm_after_name(tokenizer) == gap
        prompt = build_prompt(tokenizer, MSGS, TOOLS, tool_choice="required", named_tool="get_weather")
        assert prompt.prefill == "<tool_call>get_weather" + gap and prompt.forced == "get_weather"
