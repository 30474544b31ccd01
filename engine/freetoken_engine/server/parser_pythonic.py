"""Tool calls written as Python calls, LFM2's format (``style="pythonic"``):

    <|tool_call_start|>[get_weather(city="Paris", days=3), search(query='rain')]<|tool_call_end|>

The block's body is a Python list of calls, each argument a keyword with a literal value
(strings, numbers, True/False/None and JSON's true/false/null, lists, dicts); LFM2 may also write
a JSON list of ``{"name": ..., "arguments": ...}`` objects there, which is read too.
``PythonicBlock`` reads the text after the opening tag as ``parser_list.CallList`` does (the same
``feed``/``finish``/``state``/``unread``/``index``): the calls come whole when the block closes;
a body that is neither form is the model's text (``unread``, with the closing tag and what
follows it), so nothing it wrote is lost.
"""
from __future__ import annotations

import ast
import json

from .parser_text import ToolArgs, ToolEnd, ToolStart, parse_whole

PYTHONIC_OPEN, PYTHONIC_CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _literal(node: ast.AST):
    """A literal's value; ValueError for anything that is not one."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {str(_literal(k)): _literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


def parse_calls(body: str) -> list[tuple[str, str]] | None:
    """``[f(k=v, ...), ...]`` (or one call without the brackets, or a JSON list of call objects)
    -> [(name, arguments JSON text)], else None."""
    text = body.strip()
    if text.startswith(("[{", "{")):
        try:
            items = json.loads(text)
        except ValueError:
            return None
        calls = [parse_whole(json.dumps(item)) for item in (items if isinstance(items, list) else [items])]
        return None if not calls or None in calls else calls
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    out = []
    for node in nodes:
        if not (isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)) and not node.args):
            return None
        name = ast.unparse(node.func)
        try:
            args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(args) != len(node.keywords):
            return None                          # **kwargs
        out.append((name, json.dumps(args, ensure_ascii=False)))
    return out or None


class PythonicBlock:
    def __init__(self, first: int):
        self.index = first           # the next call's index
        self.state = "body"          # body | done | failed
        self.unread = ""
        self._buf = ""

    def feed(self, text: str) -> tuple[list, str]:
        self._buf += text
        at = self._buf.find(PYTHONIC_CLOSE)
        if at == -1:
            return [], ""
        body, rest = self._buf[:at], self._buf[at + len(PYTHONIC_CLOSE):]
        calls = parse_calls(body)
        if calls is None:
            self.state, self.unread = "failed", self._buf
            return [], ""
        self.state = "done"
        return self._events(calls), rest

    def finish(self) -> list:
        """The end of generation inside the block: its calls if the body so far is whole ones
        (a list cut before its ``]``, or inside its last call's parentheses, is closed)."""
        calls = next((c for end in ("", "]", ")]") if (c := parse_calls(self._buf + end)) is not None), None) \
            if self._buf.strip() else None
        if calls is None:
            self.unread = self._buf
            return []
        return self._events(calls)

    def _events(self, calls: list[tuple[str, str]]) -> list:
        out: list = []
        for name, args in calls:
            out += [ToolStart(self.index, name), ToolArgs(self.index, args), ToolEnd(self.index)]
            self.index += 1
        return out
