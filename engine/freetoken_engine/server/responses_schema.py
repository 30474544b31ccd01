"""OpenAI Responses request bodies (``/v1/responses``), their validation, and their conversion
to chat-template messages.

The server keeps no state between requests: a conversation is sent whole in ``input`` (as
Codex and other agents do with ``store: false``), so ``previous_response_id`` and
``conversation`` are refused with a 400 that says so. ``store``, ``metadata``, ``user``,
``truncation`` and other platform fields are accepted and ignored, as are ``include`` values
other than ``message.output_text.logprobs``; unknown fields are ignored.

Tools (``ToolSet``): ``function`` tools as they are; ``custom`` tools (free-text input, e.g.
Codex's ``apply_patch``) shown to the model as a function of one string parameter ``input``
whose description carries the tool's grammar; a ``namespace``'s tools (Codex's MCP servers)
under the name ``NAMESPACE.NAME``. Hosted tools that run on OpenAI's side (web search, image
generation, file search, ...) cannot run here and are left out of the prompt, so an agent that
sends them by default still works.

Input items become the template's messages (``prompt.build_prompt`` merges the leading system
ones and places later ones): ``instructions`` a first system message; a ``message`` item its role's message (text
parts only); a ``reasoning`` item the next assistant message's ``reasoning_content``;
``function_call`` / ``custom_tool_call`` items ``tool_calls`` on the assistant message they
follow (consecutive calls: one message); their outputs ``tool`` messages with the call's id and
name (an image or file in a tool's output becomes a note that it was left out: Codex's
``view_image`` returns one, and refusing it would end the session).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, ValidationError

from .errors import ApiError, unsupported
from .structured import format_grammar
from .generation import MAX_TOKENS_LIMIT, GenOptions
from .openai_schema import TOOL_NAME, Body, ContentPart
from .prompt import EFFORTS, NON_TEXT_RESULT, arguments_object, check_tool_schema
from .tool_turns import RESPONSES, check_tool_turns

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
CALLS = ("function_call", "custom_tool_call")
OUTPUTS = ("function_call_output", "custom_tool_call_output")


class InputItem(Body):
    type: str | None = None          # "message" when absent (an EasyInputMessage)
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None
    arguments: str | dict | None = None
    input: str | None = None         # a custom tool call's text
    output: str | list[ContentPart] | None = None
    summary: list[ContentPart] | None = None


class Tool(Body):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    format: dict[str, Any] | None = None          # a custom tool's input format
    tools: list[dict[str, Any]] | None = None     # a namespace's tools


class NamedChoice(Body):
    type: Literal["function", "custom"]
    name: str


@dataclass
class ToolSet:
    """The request's tools as the chat template sees them (``template``) and, by the name the
    model sees, what each one is: ``(kind, namespace, name)``, kind ``function`` or ``custom``."""
    template: list[dict] = field(default_factory=list)
    kinds: dict[str, tuple[str, str | None, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, tools: list[Tool] | None) -> "ToolSet":
        out = cls()
        for k, tool in enumerate(tools or ()):
            if tool.type == "namespace":
                if not _valid_name(tool.name):
                    raise ApiError(400, f"tools.{k}: a namespace needs a 'name' of letters, digits and _.:-",
                                   param=f"tools.{k}")
                for j, raw in enumerate(tool.tools or ()):
                    try:
                        inner = Tool.model_validate(raw)
                    except ValidationError as exc:
                        raise ApiError(400, f"tools.{k}.tools.{j}: {exc.errors()[0]['msg']}",
                                       param=f"tools.{k}.tools.{j}") from None
                    out._add(inner, f"tools.{k}.tools.{j}", tool.name)
            else:
                out._add(tool, f"tools.{k}", None)
        return out

    def _add(self, tool: Tool, where: str, namespace: str | None) -> None:
        if tool.type not in ("function", "custom"):
            return                        # hosted (web_search, ...): runs on OpenAI's side only
        if not _valid_name(tool.name):
            raise ApiError(400, f"{where}: a {tool.type} tool needs a 'name' of 1-256 letters, digits and _.:-",
                           param=where)
        shown = qualified(tool.name, namespace)
        if tool.type == "function":
            if tool.parameters is not None:
                check_tool_schema(shown, tool.parameters, where)
            fn = tool.model_dump(exclude_none=True, include={"name", "description", "parameters", "strict"})
        else:
            fn = {"name": tool.name, "description": tool.description or "",
                  "parameters": {"type": "object", "required": ["input"], "properties": {
                      "input": {"type": "string", "description": _custom_input(tool.format, where)}}}}
        fn["name"] = shown
        self.template.append({"type": "function", "function": fn})
        self.kinds[shown] = (tool.type, namespace, tool.name)


def qualified(name: str, namespace: str | None) -> str:
    """The name the model sees for a tool, namespaced or not."""
    return f"{namespace}.{name}" if namespace else name


def _valid_name(name: str | None) -> bool:
    return name is not None and re.fullmatch(TOOL_NAME, name) is not None


def _custom_input(fmt: dict | None, where: str) -> str:
    """What a custom tool's one string parameter holds, told to the model."""
    fmt = fmt or {"type": "text"}
    if fmt.get("type", "text") == "text":
        return "The tool's whole input, as free text."
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        return (f"The tool's whole input, as text in this {fmt.get('syntax', 'lark')} grammar "
                f"(not enforced; write it exactly):\n{fmt['definition']}")
    raise ApiError(400, f"{where}.format: a custom tool's format is {{'type': 'text'}} or "
                        "{'type': 'grammar', 'syntax', 'definition'}", param=f"{where}.format")


class ReasoningOptions(Body):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(Body):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=1 << 20)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stream: bool | None = False
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningOptions | None = None
    text: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.previous_response_id is not None:
            raise unsupported("previous_response_id", "is not supported: this server stores no "
                                                      "responses; send the whole conversation in 'input'")
        if self.conversation is not None:
            raise unsupported("conversation", "is not supported: this server stores no conversations; "
                                              "send the whole conversation in 'input'")
        if self.prompt is not None:
            raise unsupported("prompt", "(a stored prompt template) is not supported")
        if self.background:
            raise unsupported("background", "is not supported: responses run in the request")
        if isinstance(self.input, list) and not self.input and not self.instructions:
            raise unsupported("input", "must not be empty (or give 'instructions')")
        tools = self.tool_set
        if isinstance(self.tool_choice, NamedChoice) or self.tool_choice == "required":
            if not tools.kinds:
                raise unsupported("tool_choice", "needs function or custom 'tools'")
        if isinstance(self.tool_choice, NamedChoice) and self.tool_choice.name not in tools.kinds:
            raise unsupported("tool_choice", f"names '{self.tool_choice.name}', which is not in 'tools'")

    def options(self) -> GenOptions:
        return GenOptions(max_tokens=self.max_output_tokens,
                          temperature=1.0 if self.temperature is None else self.temperature,
                          top_p=1.0 if self.top_p is None else self.top_p,
                          top_k=0 if self.top_k in (None, -1) else self.top_k, seed=self.seed,
                          logprobs=self.logprobs,
                          grammar=format_grammar((self.text or {}).get("format"), "text.format",
                                                 nested=False))

    @property
    def logprobs(self) -> int | None:
        """Alternatives per token when the output text's log-probabilities are asked for
        (``include: ["message.output_text.logprobs"]`` or ``top_logprobs``), else None."""
        if "message.output_text.logprobs" in (self.include or ()) or self.top_logprobs is not None:
            return self.top_logprobs or 0
        return None

    @functools.cached_property
    def tool_set(self) -> ToolSet:
        """The tools as the template sees them (checked: a bad one is a 400)."""
        return ToolSet.of(self.tools)

    def template_kwargs(self) -> dict:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning is not None and self.reasoning.effort in ("none", "minimal"):
            kwargs.setdefault("enable_thinking", False)
        elif self.reasoning is not None and self.reasoning.effort in EFFORTS:   # gpt-oss's template reads it
            kwargs.setdefault("reasoning_effort", self.reasoning.effort)
        return kwargs

    def template_messages(self) -> list[dict]:
        out: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        wheres = ["instructions"] * len(out)   # where each template message comes from
        names: dict[str, str] = {}          # call_id -> tool name, for the outputs
        reasoning: list[str] = []           # reasoning items waiting for their assistant message
        for i, item in enumerate(self.input):
            where = f"input.{i}"
            kind = item.type or "message"
            if kind == "reasoning":
                reasoning.append(_text(item.content if item.content else item.summary, where))
            elif kind == "message":
                if item.role is None:
                    raise ApiError(400, f"{where}: a message needs a 'role'", param=where)
                role = "system" if item.role == "developer" else item.role
                msg = {"role": role, "content": _text(item.content, f"{where}.content")}
                if role == "assistant":
                    _take_reasoning(msg, reasoning)
                out.append(msg)
                wheres.append(where)
            elif kind in CALLS:
                if not item.call_id or not item.name:
                    raise ApiError(400, f"{where}: a {kind} needs 'call_id' and 'name'", param=where)
                name = qualified(item.name, item.namespace)
                names[item.call_id] = name
                last = out[-1] if out else None
                if last is None or last["role"] != "assistant" or reasoning:
                    last = {"role": "assistant", "content": ""}
                    _take_reasoning(last, reasoning)
                    out.append(last)
                    wheres.append(where)
                args = ({"input": item.input or ""} if kind == "custom_tool_call"
                        else arguments_object(item.arguments, where))
                last.setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": args}})
            elif kind in OUTPUTS:
                if not item.call_id:
                    raise ApiError(400, f"{where}: a {kind} needs 'call_id'", param=where)
                msg = {"role": "tool", "tool_call_id": item.call_id,
                       "content": _text(item.output, f"{where}.output", tool_result=True)}
                if item.call_id in names:
                    msg["name"] = names[item.call_id]
                out.append(msg)
                wheres.append(where)
            elif kind == "item_reference":
                raise unsupported(where, "is an item reference; this server stores no items, send the item itself")
            else:
                raise unsupported(where, f"has type '{kind}'; supported: message, reasoning, function_call, "
                                         "function_call_output, custom_tool_call, custom_tool_call_output")
        check_tool_turns(out, wheres, RESPONSES)
        return out              # reasoning with no assistant message after it: the template shows none


def _take_reasoning(msg: dict, reasoning: list[str]) -> None:
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
        reasoning.clear()


def _text(content, where: str, tool_result: bool = False) -> str:
    """Text parts joined; in a tool's result other parts (images, files) become a note."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if tool_result and part.type not in TEXT_PARTS:
            texts.append(NON_TEXT_RESULT.format(kind=part.type.removeprefix("input_")))
            continue
        if part.type not in TEXT_PARTS or part.text is None:
            raise ApiError(400, f"{where}.{j}: only text parts are supported, got type '{part.type}'",
                           param=where)
        texts.append(part.text)
    return "".join(texts)
