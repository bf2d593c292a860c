"""OpenAI request bodies for ``/v1/chat/completions`` and ``/v1/completions``.

Fields follow the order of OpenAI's API reference; the non-OpenAI extras sit in
one marked block at the end of each model. Every field OpenAI defines but this
server does not implement is declared with :func:`refuse`, so it is accepted
only when absent or neutral (``null``, ``[]``, ``{"type": "text"}``, ...) and
refused with a 400 naming it otherwise; any other unknown field is refused by
``extra="forbid"``. Nothing a client asks for is silently ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema
from pydantic_core.core_schema import ValidationInfo

from gateway.wire.rules import (
    MAX_TOKENS_ZERO_RULE,
    STREAM_OPTIONS_RULE,
    TOOL_CHOICE_RULE,
    TOP_LOGPROBS_RULE,
)
from gateway.wire.tool_specs import MAX_TOOLS, ChatTool, ResponseFormat, ToolCall, ToolChoice

MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n per prompt
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 64) - 1


def refuse(*neutral: Any) -> Refused:
    """The annotation of a field this server does not implement: ``None`` and the
    given neutral values pass (as ``None``), anything else is refused by name."""
    return Refused(neutral)


def invalid_value(param: str, message: str) -> PydanticCustomError:
    """A field's value the server refuses, with the field named as OpenAI's ``param``."""
    return PydanticCustomError("invalid_value", message, {"param": param})


def _integral(value: Any) -> Any:
    """JSON Schema's ``integer`` includes 16.0, and so does OpenAI's API: an integral
    float is that integer (``true`` stays a boolean, 16.5 stays refused)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An optional integer field: an integer, a float with no fractional part, or null (its
# bounds, given by ``Field``, stay in the published schema as minimum and maximum).
OptionalInt = Annotated[int | None, BeforeValidator(_integral)]
Integral = Annotated[int, BeforeValidator(_integral)]  # the same, never null


class Refused:
    """See :func:`refuse`. A neutral value must be a JSON-equal one: ``true`` is not ``1``."""

    def __init__(self, neutral: tuple[Any, ...]) -> None:
        self.neutral = neutral

    def _accepts(self, value: Any) -> bool:
        return value is None or any(isinstance(value, bool) == isinstance(ok, bool)
                                    and value == ok for ok in self.neutral)

    def _check(self, value: Any, info: ValidationInfo) -> None:
        if self._accepts(value):
            return None
        raise PydanticCustomError(
            "unsupported_parameter",
            "'{field}' is not supported by this server.",
            {"field": info.field_name},
        )

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler
                                     ) -> core_schema.CoreSchema:
        return core_schema.with_info_before_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"enum": [None, *self.neutral],
                "description": "Not supported by this server: only null"
                               + "".join(f" or {json.dumps(v)}" for v in self.neutral)
                               + " is accepted."}


class _Strict(BaseModel):
    # Values are not coerced between JSON types ("3" is not 3, 1 is not true), as in
    # OpenAI's API and in the JSON schema that /openapi.json publishes.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class SpeculationOptions(_Strict):
    """Extra: per-request control of speculative decoding."""

    enabled: bool = True
    drafter: str | None = None  # a loaded drafter by name ("ngram", "draft"), "none" = off
    max_draft_tokens: OptionalInt = Field(default=None, ge=0, le=64)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


def _content(value: Any) -> Any:
    """String content or an array of text parts; other part types are refused."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("invalid_content", "content must be a string or an array "
                                                     "of content parts")
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise PydanticCustomError(
                "unsupported_parameter",
                "content part {index} has type '{kind}'; only 'text' parts are supported.",
                {"index": i, "kind": str(kind)},
            )
    return value


def _predicted(value: str | list[TextPart]) -> str | list[TextPart]:
    if not (value if isinstance(value, str) else any(part.text for part in value)):
        raise PydanticCustomError("invalid_value", "a prediction's content must not be empty")
    return value


class Prediction(_Strict):
    """Predicted output: text most of the answer is expected to repeat (a file being
    edited), drafted from so that matching runs come out several tokens a pass. It
    changes the speed, never the text."""

    type: Literal["content"]
    content: Annotated[str | list[TextPart], AfterValidator(_predicted)]

    def text(self) -> str:
        """The predicted text: the string, or the parts' texts joined."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatMessage(_Strict):
    """A system, developer, user, assistant or tool message. ``content`` may be null
    only on an assistant message that carries ``tool_calls``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, json_schema_extra={
        "allOf": [  # the role rules ``_check_roles`` enforces, for /openapi.json
            {"if": {"properties": {"role": {"const": "tool"}}},
             "then": {"required": ["tool_call_id"],
                      "properties": {"tool_call_id": {"type": "string"}}},
             "else": {"properties": {"tool_call_id": {"type": "null"}}}},
            {"if": {"properties": {"content": {"type": "null"}}},
             "then": {"properties": {"role": {"const": "assistant"},
                                     "tool_calls": {"type": "array", "minItems": 1}},
                      "required": ["tool_calls"]}},
            {"if": {"properties": {"tool_calls": {"type": "array", "minItems": 1}},
                    "required": ["tool_calls"]},
             "then": {"properties": {"role": {"const": "assistant"}}}},
        ]})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, BeforeValidator(_content)]
    name: Annotated[Any, refuse()] = None
    # Assistant-message fields a client may echo back from an earlier response.
    audio: Annotated[Any, refuse()] = None
    function_call: Annotated[Any, refuse()] = None
    refusal: Annotated[Any, refuse()] = None
    tool_calls: list[ToolCall] | None = None
    annotations: Annotated[Any, refuse([])] = None
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _check_roles(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise invalid_value("content", "content may be null only on an assistant message with "
                                "tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise invalid_value("tool_calls", "only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise invalid_value("tool_call_id", "tool_call_id is required on tool messages and "
                                "only there")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


def _stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
        raise PydanticCustomError("too_many_stop", "at most {n} stop sequences are allowed",
                                  {"n": MAX_STOP_SEQUENCES})
    return value


StopField = Annotated[
    str | list[str] | None,
    BeforeValidator(_stop),
    WithJsonSchema({"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP_SEQUENCES},
        {"type": "null"},
    ]}),
]


def _check_common(request: ChatCompletionRequest | CompletionRequest) -> None:
    if request.stream_options is not None and not request.stream:
        raise invalid_value("stream_options", "stream_options is only allowed when stream is true")


class ChatCompletionRequest(_Strict):
    """``POST /v1/chat/completions``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, json_schema_extra={
        "allOf": [*STREAM_OPTIONS_RULE["allOf"], TOP_LOGPROBS_RULE, TOOL_CHOICE_RULE]})
    messages: list[ChatMessage] = Field(min_length=1)
    model: str
    audio: Annotated[Any, refuse()] = None
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    function_call: Annotated[Any, refuse("none")] = None
    functions: Annotated[Any, refuse([])] = None
    logit_bias: Annotated[Any, refuse({})] = None
    logprobs: bool | None = False
    max_completion_tokens: OptionalInt = Field(default=None, ge=1)
    max_tokens: OptionalInt = Field(default=None, ge=1)
    metadata: Annotated[Any, refuse({})] = None
    modalities: Annotated[Any, refuse(["text"])] = None
    n: OptionalInt = Field(default=1, ge=1, le=MAX_CHOICES)
    parallel_tool_calls: bool | None = None
    prediction: Prediction | None = None
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    prompt_cache_key: Annotated[Any, refuse()] = None
    reasoning_effort: Annotated[Any, refuse()] = None
    response_format: ResponseFormat | None = None
    safety_identifier: Annotated[Any, refuse()] = None
    seed: OptionalInt = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    service_tier: Annotated[Any, refuse("auto", "default")] = None
    stop: StopField = None
    store: Annotated[Any, refuse(False)] = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    tool_choice: ToolChoice | None = Field(
        default=None, description="A named function must be one of tools (refused otherwise).")
    tools: list[ChatTool] | None = Field(
        default=None, max_length=MAX_TOOLS,
        description="Function names must be unique (a request that repeats one is refused).")
    top_logprobs: OptionalInt = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    user: str | None = None
    verbosity: Annotated[Any, refuse()] = None
    web_search_options: Annotated[Any, refuse()] = None
    # -- extras (not in OpenAI's API) ----------------------------------------------------
    top_k: OptionalInt = Field(default=None, ge=0)
    speculation: SpeculationOptions | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        _check_common(self)
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise invalid_value("tools", "tool function names must be unique")
        choice = self.tool_choice
        if choice is not None and not isinstance(choice, str) and choice.function.name not in names:
            raise invalid_value("tool_choice", "tool_choice names a function that is not in tools")
        if choice == "required" and not names:
            raise invalid_value("tool_choice", "tool_choice 'required' needs tools")
        if self.top_logprobs and not self.logprobs:
            raise invalid_value("top_logprobs", "The 'top_logprobs' parameter is only allowed "
                                "when 'logprobs' is enabled.")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise invalid_value("max_tokens", "max_tokens and max_completion_tokens disagree; "
                                "send one")
        return self

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The asked-for limit and the field that carried it."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


def _prompt(value: Any) -> Any:
    """A string, a list of strings, a token-id list, or a list of token-id lists."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # token ids sent as integral floats are those ids
        value = [[_integral(t) for t in v] if isinstance(v, list) else _integral(v)
                 for v in value]
    if not isinstance(value, list) or not value:
        raise PydanticCustomError(
            "invalid_prompt", "prompt must be a string, a non-empty array of strings, an "
                              "array of token ids or an array of token-id arrays")
    if all(isinstance(v, str) for v in value):
        return value
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    if all(isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool)
                                             for t in v) for v in value):
        return value
    raise PydanticCustomError(
        "invalid_prompt", "prompt must be a string, an array of strings, an array of token "
                          "ids or an array of non-empty token-id arrays (not a mix)")


# ids below the vocabulary's size: /openapi.json adds the maximum once the model is loaded
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PromptField = Annotated[
    str | list[str] | list[int] | list[list[int]],
    BeforeValidator(_prompt),
    WithJsonSchema({"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
    ]}),
]


class CompletionRequest(_Strict):
    """``POST /v1/completions`` (the legacy text endpoint). With a ``suffix`` (a model with
    fill-in-the-middle tokens) the answer is what goes between the prompt and it. With
    ``echo`` and ``logprobs`` the prompt's tokens come back with their log-probabilities
    (the first one's null) before the completion's; ``max_tokens: 0`` (only with
    ``echo``) returns the prompt alone."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, json_schema_extra={
        "allOf": [*STREAM_OPTIONS_RULE["allOf"], MAX_TOKENS_ZERO_RULE]})
    model: str
    prompt: PromptField
    best_of: Annotated[Any, refuse(1)] = None
    echo: bool | None = False
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: Annotated[Any, refuse({})] = None
    logprobs: OptionalInt = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tokens: OptionalInt = Field(
        default=None, ge=0, description="0 (with echo only): the prompt alone, nothing new.")
    n: OptionalInt = Field(default=1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    seed: OptionalInt = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: StopField = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = Field(
        default=None, description="The text after the gap to fill (fill-in-the-middle): "
        "for a model whose vocabulary has fill-in-the-middle tokens (refused otherwise); "
        "not with echo. An empty suffix is no suffix.")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    user: str | None = None
    # -- extras (not in OpenAI's API) ----------------------------------------------------
    top_k: OptionalInt = Field(default=None, ge=0)
    speculation: SpeculationOptions | None = None
    response_format: ResponseFormat | None = None  # as on chat completions
    prediction: Prediction | None = None  # as on chat completions

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        _check_common(self)
        if self.max_tokens == 0 and not self.echo:
            raise invalid_value("max_tokens", "max_tokens 0 generates nothing: it is allowed only "
                                "with echo (the prompt alone, with its logprobs when logprobs is "
                                "set)")
        if self.suffix and self.echo:
            raise invalid_value("echo", "echo cannot be combined with suffix: the answer is the "
                                "middle of the text, and there is no one prompt to show before it")
        return self

    @property
    def prompt_logprobs(self) -> bool:
        """Whether the prompt's own tokens are scored (``echo`` with ``logprobs``)."""
        return bool(self.echo) and self.logprobs is not None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts as a list: strings, or token-id lists."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        ids = [p for p in self.prompt if isinstance(p, int)]
        if ids:
            return [ids]
        return [p for p in self.prompt if isinstance(p, str | list)]
