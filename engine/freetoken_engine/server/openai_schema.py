"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) and their validation.

Pydantic checks types and ranges (a violation is a 400 naming the field). ``check_supported``
rejects parameters this server does not implement with a 400 that names the parameter; fields
that only tune OpenAI's platform (``user``, ``store``, ``metadata``, ``service_tier``, ...) are
accepted and ignored, and unknown fields are ignored, so agents that send extras keep working.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import ApiError, unsupported
from .generation import MAX_TOKENS_LIMIT, GenOptions
from .structured import format_grammar, logit_bias, structured_grammar

TOOL_NAME = r"^[A-Za-z0-9_.:-]{1,256}$"
#: most choices one request may ask for (``n``): each is a request of its own in the scheduler
MAX_CHOICES = 32


class Body(BaseModel):
    """A request body or part of one (every protocol's): unknown fields are ignored, and a float
    field refuses NaN and Infinity (which Python's JSON parser accepts) as not finite."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ContentPart(Body):
    type: str
    text: str | None = None


class FunctionCall(Body):
    name: str
    arguments: str | dict | None = None


class ToolCall(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(Body):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Body):
    include_usage: bool | None = None


class _Sampling(Body):
    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=1 << 20)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)   # vLLM's extension
    min_p: float | None = Field(None, ge=0.0, le=1.0)                # vLLM's extension
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None      # vLLM's: json, regex, choice, grammar

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def common_checks(self) -> None:
        if len(self.stops()) > 16:
            raise unsupported("stop", "accepts at most 16 strings")
        if self.stream_options is not None and not self.stream:
            raise unsupported("stream_options", "is only allowed with stream=true")

    def grammar(self) -> str | None:
        """The answer's grammar from ``response_format`` or ``structured_outputs`` (400s name the
        field that is wrong)."""
        fmt = format_grammar(self.response_format, "response_format", nested=True)
        other = structured_grammar(self.structured_outputs)
        if fmt is not None and other is not None:
            raise ApiError(400, "give one of 'response_format' and 'structured_outputs'",
                           param="structured_outputs")
        return fmt if fmt is not None else other

    def options(self, max_tokens: int | None, logprobs: int | None = None) -> GenOptions:
        temperature = 1.0 if self.temperature is None else self.temperature
        top_k = 0 if self.top_k in (None, -1) else self.top_k
        return GenOptions(max_tokens=max_tokens, temperature=temperature,
                          top_p=1.0 if self.top_p is None else self.top_p, top_k=top_k,
                          seed=self.seed, stop=self.stops(), ignore_eos=bool(self.ignore_eos),
                          logit_bias=logit_bias(self.logit_bias), logprobs=logprobs,
                          grammar=self.grammar(), presence_penalty=self.presence_penalty or 0.0,
                          frequency_penalty=self.frequency_penalty or 0.0,
                          repetition_penalty=self.repetition_penalty or 1.0, min_p=self.min_p or 0.0)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None

    def check_supported(self) -> None:
        self.common_checks()
        if self.top_logprobs is not None and not self.logprobs:
            raise unsupported("top_logprobs", "needs 'logprobs': true")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise unsupported(name, "is deprecated and not supported; use 'tools' and "
                                        "'tool_choice'")
        for name in ("audio", "prediction", "web_search_options"):
            if getattr(self, name) is not None:
                raise unsupported(name)
        if self.modalities and set(self.modalities) - {"text"}:
            raise unsupported("modalities", "supports only ['text']")
        if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
            if not self.tools:
                raise unsupported("tool_choice", "needs 'tools'")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or ()}
            if self.tool_choice.function.name not in names:
                raise unsupported("tool_choice", f"names '{self.tool_choice.function.name}', "
                                                 "which is not in 'tools'")

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat_options(self) -> GenOptions:
        return self.options(self.max_new, (self.top_logprobs or 0) if self.logprobs else None)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=5)

    def check_supported(self) -> None:
        self.common_checks()
        if self.echo:
            raise unsupported("echo")
        if self.suffix:
            raise unsupported("suffix")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "must be 1")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) != 1:
            raise unsupported("prompt", "must be one prompt (a batch of prompts is not supported)")
        if isinstance(p, list) and not p:
            raise unsupported("prompt", "must not be empty")
