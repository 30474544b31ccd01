"""OpenAI Responses request bodies (``/v1/responses``), their validation, and their conversion
to chat-template messages.

The server keeps no state between requests: a conversation is sent whole in ``input`` (as
Codex and other agents do with ``store: false``), so ``previous_response_id`` and
``conversation`` are refused with a 400 that says so. ``store``, ``metadata``, ``user``,
``truncation``, ``include`` and other platform fields are accepted and ignored; unknown fields
are ignored. Only function tools run here: hosted tools (web search, file search, computer use)
are a 400 naming the tool.

Input items become the template's messages: ``instructions`` a first system message; a
``message`` item its role's message (``developer`` as ``system``; text parts only); a
``reasoning`` item the next assistant message's ``reasoning_content``; ``function_call`` items
``tool_calls`` on the assistant message they follow (consecutive calls: one message); a
``function_call_output`` a ``tool`` message with its call's id and name.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import ApiError, unsupported
from .generation import MAX_TOKENS_LIMIT, GenOptions
from .openai_schema import TOOL_NAME
from .prompt import arguments_object, check_tool_schema

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Part(_Body):
    type: str
    text: str | None = None


class InputItem(_Body):
    type: str | None = None          # "message" when absent (an EasyInputMessage)
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | dict | None = None
    output: str | list[Part] | None = None
    summary: list[Part] | None = None


class FunctionTool(_Body):
    type: str
    name: str | None = Field(None, pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedChoice(_Body):
    type: Literal["function"]
    name: str


class ReasoningOptions(_Body):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Body):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=1 << 20)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stream: bool | None = False
    tools: list[FunctionTool] | None = None
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
    top_logprobs: int | None = None
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
        if self.top_logprobs:
            raise unsupported("top_logprobs")
        fmt = (self.text or {}).get("format") or {}
        if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
            raise unsupported("text.format", "supports only {'type': 'text'}")
        if isinstance(self.input, list) and not self.input:
            raise unsupported("input", "must not be empty")
        for k, t in enumerate(self.tools or ()):
            if t.type != "function":
                raise unsupported(f"tools.{k}", f"is a '{t.type}' tool; only function tools run on this server")
            if t.name is None:
                raise ApiError(400, f"tools.{k}: a function tool needs a 'name'", param=f"tools.{k}")
            if t.parameters is not None:
                check_tool_schema(t.name, t.parameters, f"tools.{k}")
        if isinstance(self.tool_choice, NamedChoice) or self.tool_choice == "required":
            if not self.tools:
                raise unsupported("tool_choice", "needs 'tools'")
        if isinstance(self.tool_choice, NamedChoice) and self.tool_choice.name not in {t.name for t in self.tools}:
            raise unsupported("tool_choice", f"names '{self.tool_choice.name}', which is not in 'tools'")

    def options(self) -> GenOptions:
        return GenOptions(max_tokens=self.max_output_tokens,
                          temperature=1.0 if self.temperature is None else self.temperature,
                          top_p=1.0 if self.top_p is None else self.top_p,
                          top_k=0 if self.top_k in (None, -1) else self.top_k, seed=self.seed)

    def template_tools(self) -> list[dict] | None:
        """The tools in the chat-completions shape the templates know."""
        if not self.tools:
            return None
        return [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                for t in self.tools]

    def template_kwargs(self) -> dict:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning is not None and self.reasoning.effort in ("none", "minimal"):
            kwargs.setdefault("enable_thinking", False)
        return kwargs

    def template_messages(self) -> list[dict]:
        out: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
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
            elif kind == "function_call":
                if not item.call_id or not item.name:
                    raise ApiError(400, f"{where}: a function_call needs 'call_id' and 'name'", param=where)
                names[item.call_id] = item.name
                last = out[-1] if out else None
                if last is None or last["role"] != "assistant" or reasoning:
                    last = {"role": "assistant", "content": ""}
                    _take_reasoning(last, reasoning)
                    out.append(last)
                last.setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function",
                     "function": {"name": item.name, "arguments": arguments_object(item.arguments, where)}})
            elif kind == "function_call_output":
                if not item.call_id:
                    raise ApiError(400, f"{where}: a function_call_output needs 'call_id'", param=where)
                msg = {"role": "tool", "tool_call_id": item.call_id,
                       "content": _text(item.output, f"{where}.output")}
                if item.call_id in names:
                    msg["name"] = names[item.call_id]
                out.append(msg)
            elif kind == "item_reference":
                raise unsupported(where, "is an item reference; this server stores no items, send the item itself")
            else:
                raise unsupported(where, f"has type '{kind}'; supported: message, reasoning, function_call, "
                                         "function_call_output")
        return out              # reasoning with no assistant message after it: the template shows none


def _take_reasoning(msg: dict, reasoning: list[str]) -> None:
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
        reasoning.clear()


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise ApiError(400, f"{where}.{j}: only text parts are supported, got type '{part.type}'",
                           param=where)
        texts.append(part.text)
    return "".join(texts)
