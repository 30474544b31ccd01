"""The output parser and stop strings on every way a stream can be split into pieces.

A model's text arrives in arbitrary pieces (one token can be half a tag); whatever the split,
the client must see the same reasoning, content and tool calls, and never a piece of a tag.
"""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken_engine.server.parser import (Content, OutputParser, Reasoning, ToolArgs, ToolEnd,
                                            ToolStart)
from freetoken_engine.server.stops import StopMatcher

ARGS = {"city": "Paris", "days": [1, {"a": "}]\\\"{"}], "note": "</tool_call> inside a string"}
TEXT = ("<think>Let me check the weather.</think>\n\nSure, checking. "
        '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(ARGS) + "}\n</tool_call>"
        '<tool_call>\n{"arguments": {"q": 1}, "name": "search"}\n</tool_call>')


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)]) if b > a]


def run(pieces: list[str], **kw) -> dict:
    p = OutputParser(**kw)
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    out = {"reasoning": "", "content": "", "calls": [], "ends": 0}
    for e in events:
        if isinstance(e, Reasoning):
            out["reasoning"] += e.text
        elif isinstance(e, Content):
            out["content"] += e.text
        elif isinstance(e, ToolStart):
            assert e.index == len(out["calls"])
            out["calls"].append([e.name, ""])
        elif isinstance(e, ToolArgs):
            out["calls"][e.index][1] += e.text
        elif isinstance(e, ToolEnd):
            out["ends"] += 1
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=40))
def test_any_split_gives_the_same_reasoning_content_and_tool_calls(cuts):
    out = run(split(TEXT, cuts), tools=True)
    assert out["reasoning"] == "Let me check the weather."
    assert out["content"] == "Sure, checking. "
    assert [c[0] for c in out["calls"]] == ["get_weather", "search"]
    assert out["calls"][0][1] == json.dumps(ARGS)   # the model's own JSON text, from its first brace
    assert json.loads(out["calls"][1][1]) == {"q": 1}
    assert out["ends"] == 2


def test_tool_name_is_announced_before_the_arguments_finish():
    p = OutputParser(tools=True)
    events = p.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert events[0] == ToolStart(0, "get_weather")
    assert events[1] == ToolArgs(0, '{"ci')


def test_without_tools_the_tags_are_plain_text():
    out = run(["a <tool_call>{}</tool_call>"], tools=False)
    assert out["content"] == "a <tool_call>{}</tool_call>" and out["calls"] == []


def test_unparseable_tool_call_is_returned_as_content_not_lost():
    out = run(["x <tool_call>not json</tool_call> y"], tools=True)
    assert out["calls"] == []
    assert out["content"] == "x <tool_call>not json</tool_call>y"


def test_template_opened_think_means_output_starts_as_reasoning():
    out = run(["step 1, step 2</thi", "nk>\n\nanswer"], tools=False, in_reasoning=True)
    assert out == {"reasoning": "step 1, step 2", "content": "answer", "calls": [], "ends": 0}


def test_generation_cut_inside_a_tool_call_closes_it():
    out = run(['<tool_call>{"name": "f", "arguments": {"a": 1'], tools=True)
    assert out["calls"] == [["f", '{"a": 1']] and out["ends"] == 1


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abST<>/", max_size=60), st.lists(st.integers(0, 100), max_size=12),
       st.lists(st.sampled_from(["ST", "</S>", "bab", "T"]), min_size=1, max_size=3))
def test_stop_strings_cut_at_the_first_match_whatever_the_split(text, cuts, stops):
    m = StopMatcher(stops)
    shown = "".join(m.feed(piece) for piece in split(text, cuts))
    shown += m.flush()
    hits = [i for i in (text.find(s) for s in stops) if i != -1]
    assert shown == (text[:min(hits)] if hits else text)
    assert m.stopped == bool(hits)


# -- the XML style (Qwen3.5/3.6, Qwen3-Coder) ---------------------------------------------------
XML_SCHEMAS = {"edit": {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "dry_run": {"type": "boolean"},
    "ranges": {"type": "array"}, "scale": {"type": "number"}, "code": {"type": "string"},
    "limit": {"type": ["integer", "null"]}}}}
XML_CODE = 'if a < b:\n    print("</tool_call> and <parameter=x>")\n'
XML_TEXT = ("The file needs an edit.\n<tool_call>\n<function=edit>\n<parameter=path>\nsrc/app.py\n</parameter>\n"
            "<parameter=line>\n42\n</parameter>\n<parameter=dry_run>\nFalse\n</parameter>\n"
            "<parameter=ranges>\n[[1, 3], [7, 9]]\n</parameter>\n<parameter=scale>\n0.5\n</parameter>\n"
            f"<parameter=code>\n{XML_CODE}\n</parameter>\n<parameter=limit>\nnull\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=list_files>\n</function>\n</tool_call>")
XML_ARGS = {"path": "src/app.py", "line": 42, "dry_run": False, "ranges": [[1, 3], [7, 9]], "scale": 0.5,
            "code": XML_CODE, "limit": None}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=40))
def test_xml_tool_calls_on_any_split_give_typed_arguments(cuts):
    """Qwen3.5's template opens <think> in the prompt and its model may open a tool call
    without closing it: the call ends the reasoning. Values are typed by the tool's schema; a
    value may hold "</tool_call>" and other tags; a call without parameters has {}."""
    text = "The user wants line 42 changed.\n" + XML_TEXT
    out = run(split(text, cuts), tools=True, in_reasoning=True, style="xml", schemas=XML_SCHEMAS)
    assert out["reasoning"] == "The user wants line 42 changed.\nThe file needs an edit.\n"
    assert out["content"] == ""
    assert [name for name, _ in out["calls"]] == ["edit", "list_files"] and out["ends"] == 2
    assert json.loads(out["calls"][0][1]) == XML_ARGS
    assert json.loads(out["calls"][1][1]) == {}


def test_xml_arguments_stream_a_parameter_at_a_time_after_the_name():
    p = OutputParser(tools=True, style="xml", schemas=XML_SCHEMAS)
    head = XML_TEXT.index("<parameter=line>")
    events = p.feed(XML_TEXT[:head])
    assert [type(e) for e in events] == [Content, ToolStart, ToolArgs]
    assert events[1].name == "edit" and events[2].text == '{"path": "src/app.py"'


def test_xml_values_that_do_not_fit_their_type_stay_text():
    schemas = {"f": {"properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                    "s": {"type": "string"}, "o": {"type": "object"}}}}
    body = ("<tool_call>\n<function=f>\n<parameter=n>\nabout 3\n</parameter>\n<parameter=x>\n7\n</parameter>\n"
            "<parameter=s>\n123\n</parameter>\n<parameter=o>\n{broken\n</parameter>\n"
            "<parameter=extra>\ntrue\n</parameter>\n</function>\n</tool_call>")
    out = run([body], tools=True, style="xml", schemas=schemas)
    assert json.loads(out["calls"][0][1]) == {"n": "about 3", "x": 7, "s": "123", "o": "{broken", "extra": "true"}


def test_xml_call_cut_by_the_token_limit_keeps_what_was_written():
    cut = XML_TEXT.index("</parameter>\n<parameter=line>")
    out = run([XML_TEXT[:cut]], tools=True, style="xml", schemas=XML_SCHEMAS)
    assert out["calls"] == [["edit", '{"path": "src/app.py"}']] and out["ends"] == 1


def test_xml_style_still_reads_a_json_body_and_keeps_unparseable_text():
    json_call = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
    out = run([json_call], tools=True, style="xml")
    assert out["calls"] == [["search", '{"q": "x"}']]
    garbage = "<tool_call>\nnot a call\n</tool_call> after"
    assert run([garbage], tools=True, style="xml")["content"] == garbage.replace(" after", "after")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=30))
def test_a_late_think_close_after_calls_that_ended_the_reasoning_is_not_shown(cuts):
    """Qwen3.5 may open calls inside its reasoning and close </think> only after them: the
    late tag is dropped, the text after it is content, and a later </think> (with no open
    reasoning to end) is the model's own text again."""
    call = "<tool_call>\n<function=list_files>\n</function>\n</tool_call>"
    text = "Listing first.\n" + call + "\n" + call + "\n</think>\n\nDone. Literal </think> here."
    out = run(split(text, cuts), tools=True, in_reasoning=True, style="xml")
    assert out["reasoning"] == "Listing first.\n"
    assert [name for name, _ in out["calls"]] == ["list_files", "list_files"] and out["ends"] == 2
    assert out["content"] == "Done. Literal </think> here."
