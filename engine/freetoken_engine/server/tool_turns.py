"""Tool results must answer the calls before them, as OpenAI's and Anthropic's APIs insist.

Checked on the template messages every route builds (``role``, ``tool_calls``, ``tool_call_id``):
a tool message answers a call of the assistant turn before it (system messages between turns
are passed over: Claude Code sends some), and an assistant turn's calls are all answered before
the conversation goes on. A history that breaks this is a client's bug (a result sent under the
wrong id, a call dropped while trimming history); rendered anyway, the model would read a result
under another call's name, or a call that never returned. A result without an id (some OpenAI
clients send none) is taken as answering the next unanswered call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ApiError


@dataclass(frozen=True)
class Words:
    """How one API names things in its messages, for the errors."""
    call: str                 # "tool_call" / "tool_use" / "function_call"
    result: str               # "tool message" / "tool_result" / "function_call_output"
    id_field: str             # "tool_call_id" / "tool_use_id" / "call_id"


OPENAI = Words("tool_call", "tool message", "tool_call_id")
ANTHROPIC = Words("tool_use", "tool_result", "tool_use_id")
RESPONSES = Words("function_call", "function_call_output", "call_id")


def check_tool_turns(messages: Sequence[dict], wheres: Sequence[str], words: Words) -> None:
    """Raise a 400 naming the message to fix; ``wheres[k]`` locates ``messages[k]`` in the request."""
    open_at, pending = None, []             # the assistant turn with calls, its unanswered ids
    for msg, where in zip(messages, wheres, strict=True):
        role = msg["role"]
        if role == "system":
            continue
        if role == "tool":
            if open_at is None:
                raise ApiError(400, f"{where}: a {words.result} must answer a {words.call} of the assistant "
                                    "message right before it, and there is none", param=where)
            ident = msg.get("tool_call_id")
            if ident is None and pending:
                ident = pending[0]
            if ident not in pending:
                raise ApiError(400, f"{where}: {words.id_field} '{ident}' answers no open {words.call} of the "
                                    f"assistant message before it (open: {_ids(pending)}); send each result "
                                    f"under the id of its call", param=where)
            pending.remove(ident)
            continue
        if pending:
            raise ApiError(400, f"{open_at}: its {words.call} {_ids(pending)} got no {words.result} before "
                                f"{where}; answer every call before the conversation goes on", param=open_at)
        open_at, pending = None, []
        if role == "assistant" and msg.get("tool_calls"):
            open_at, pending = where, [c.get("id") for c in msg["tool_calls"]]


def _ids(ids: Sequence[str | None]) -> str:
    return ", ".join(f"'{i}'" for i in ids) or "none"
