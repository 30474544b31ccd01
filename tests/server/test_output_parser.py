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
    assert json.loads(out["calls"][0][1]) == ARGS   # streamed raw, still exact JSON
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
