"""Anthropic Messages request bodies and their conversion to chat-template messages.

Messages are ``user``, ``assistant`` or ``system`` (text; Claude Code sends system messages
between the turns). Content blocks: ``text``, ``tool_use`` (assistant), ``tool_result``
(user), ``thinking`` and ``redacted_thinking`` (assistant history; thinking text goes back to
the template as ``reasoning_content``). Images, documents and server tools are answered with a
400 naming the block, except inside a ``tool_result``, where an image or document becomes a
note that it was left out (an agent's tool may return one; refusing it would end the agent's
session). ``cache_control`` is accepted and ignored: the prefix cache is automatic.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .errors import ApiError, unsupported
from .structured import format_grammar
from .generation import MAX_TOKENS_LIMIT, GenOptions
from .openai_schema import TOOL_NAME, Body
from .prompt import NON_TEXT_RESULT, check_tool_schema
from .tool_turns import ANTHROPIC, check_tool_turns


class Block(Body):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list["Block"] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


class Message(Body):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(Body):
    name: str = Field(pattern=TOOL_NAME)
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None      # calls must follow input_schema (structured outputs' strict tool use)


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class CountRequest(Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def template_messages(self) -> list[dict]:
        out, wheres = [], []
        if self.system:
            out.append({"role": "system", "content": _text_of(self.system, "system")})
            wheres.append("system")
        last = len(self.messages) - 1
        for i, m in enumerate(self.messages):
            if not m.content and not (i == last and m.role == "assistant"):
                # as Anthropic's API: an empty turn is a client's bug, not something to answer
                raise ApiError(400, f"messages.{i}: the content is empty; every message needs content, "
                                    "except a final assistant message", param=f"messages.{i}.content")
            for where, msg in _convert(m, f"messages.{i}"):
                wheres.append(where)
                out.append(msg)
        check_tool_turns(out, wheres, ANTHROPIC)
        return out

    def template_tools(self) -> list[dict] | None:
        if not self.tools:
            return None
        tools = []
        for k, t in enumerate(self.tools):
            if t.type not in (None, "custom"):
                raise unsupported(f"tools.{k}.type", f"'{t.type}' (server tools) is not supported")
            schema = t.input_schema if t.input_schema is not None else {"type": "object"}
            check_tool_schema(t.name, schema, f"tools.{k}.input_schema")
            fn = {"name": t.name, "parameters": schema}
            if t.description:
                fn["description"] = t.description
            if t.strict:
                fn["strict"] = True
            tools.append({"type": "function", "function": fn})
        return tools

    def choice(self) -> tuple[str, str | None]:
        """(mode, named tool) for build_prompt."""
        tc = self.tool_choice
        if tc is None or tc.type == "auto":
            return "auto", None
        if tc.type == "none":
            return "none", None
        if not self.tools:
            raise unsupported("tool_choice", "needs 'tools'")
        if tc.type == "any":
            return "required", None
        if tc.name not in {t.name for t in self.tools}:
            raise unsupported("tool_choice.name", f"'{tc.name}' is not one of 'tools'")
        return "auto", tc.name

    def parallel_calls(self) -> bool:
        """Whether a forced answer may hold more than one call (``disable_parallel_tool_use``)."""
        return not (self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use)

    def template_kwargs(self) -> dict:
        """Anthropic thinks only when asked: no ``thinking`` means ``enable_thinking=False`` for
        templates that have the switch (Qwen3); others ignore the variable. A thinking budget
        becomes a reasoning effort (gpt-oss's template reads ``reasoning_effort``): under 4,096
        tokens low, under 16,384 medium, else high."""
        thinking = self.thinking is not None and self.thinking.type != "disabled"
        kwargs = {"enable_thinking": thinking}
        budget = self.thinking.budget_tokens if thinking else None
        if budget is not None:
            kwargs["reasoning_effort"] = "low" if budget < 4096 else "medium" if budget < 16384 else "high"
        return kwargs


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    mcp_servers: list[Any] | None = None
    container: Any = None
    output_config: dict[str, Any] | None = None     # {"format": {"type": "json_schema", "schema"}}
    output_format: dict[str, Any] | None = None     # the beta's name for that format

    def check_supported(self) -> None:
        for name in ("mcp_servers", "container"):
            if getattr(self, name):
                raise unsupported(name)

    def options(self) -> GenOptions:
        return GenOptions(max_tokens=self.max_tokens,
                          temperature=1.0 if self.temperature is None else self.temperature,
                          top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                          stop=tuple(s for s in self.stop_sequences or () if s),
                          grammar=self.grammar())

    def grammar(self) -> str | None:
        fmt = (self.output_config or {}).get("format")
        if fmt is not None and self.output_format is not None:
            raise ApiError(400, "give one of 'output_config.format' and 'output_format'",
                           param="output_format")
        if fmt is not None:
            return format_grammar(fmt, "output_config.format", nested=False)
        return format_grammar(self.output_format, "output_format", nested=False)


def _text_of(content, where: str, tool_result: bool = False) -> str:
    """Text blocks joined; in a tool's result other blocks (images, documents) become a note."""
    if isinstance(content, str):
        return content
    parts = []
    for j, b in enumerate(content):
        if tool_result and b.type != "text":
            parts.append(NON_TEXT_RESULT.format(kind=b.type))
            continue
        if b.type != "text" or b.text is None:
            raise ApiError(400, f"{where}.{j}: expected a text block, got '{b.type}'",
                           param=where)
        parts.append(b.text)
    return "".join(parts)


def _convert(m: Message, where: str) -> list[tuple[str, dict]]:
    """One Anthropic message -> one or more template messages (tool results become 'tool'), each
    with where in the request it comes from."""
    if m.role == "system":        # between the turns (Claude Code sends these)
        return [(where, {"role": "system", "content": _text_of(m.content, f"{where}.content")})]
    if isinstance(m.content, str):
        return [(where, {"role": m.role, "content": m.content})]
    out: list[tuple[str, dict]] = []
    text, reasoning, calls = [], [], []
    for j, b in enumerate(m.content):
        at = f"{where}.content.{j}"
        if b.type == "text" and b.text is not None:
            text.append(b.text)
        elif b.type == "thinking" and m.role == "assistant":
            reasoning.append(b.thinking or "")
        elif b.type == "redacted_thinking" and m.role == "assistant":
            continue
        elif b.type == "tool_use" and m.role == "assistant":
            if not b.name:
                raise ApiError(400, f"{at}: tool_use needs 'name'", param=at)
            calls.append({"id": b.id or "", "type": "function",
                          "function": {"name": b.name, "arguments": b.input or {}}})
        elif b.type == "tool_result" and m.role == "user":
            body = "" if b.content is None else _text_of(b.content, f"{at}.content", tool_result=True)
            out.append((at, {"role": "tool", "tool_call_id": b.tool_use_id, "content": body}))
        else:
            raise ApiError(400, f"{at}: content block type '{b.type}' is not supported in a "
                                f"{m.role} message", param=at)
    if text or calls or reasoning or not out:
        msg: dict = {"role": m.role, "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        out.append((where, msg))   # after any tool results: they answer the previous assistant turn
    return out
