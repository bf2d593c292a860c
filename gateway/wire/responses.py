"""``POST /v1/responses`` request body (stateless), and its conversion to the chat
request the rest of the gateway already serves.

Stateless: ``store: true`` and ``previous_response_id`` are refused with a 400 (no
response is kept, so none can be continued); the client sends the whole
conversation as ``input`` items instead.

Tools: functions, and ``namespace`` tools whose functions the model sees under one
flat name each (``FunctionNames``); hosted tools the server cannot run
(``web_search``, ``file_search``, ...) are accepted and left out of what the model
sees (docs/structured-outputs.md, "Tools: functions, namespaces and hosted tools").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from gateway.wire.requests import (
    ChatCompletionRequest,
    OptionalInt,
    SpeculationOptions,
    invalid_value,
    refuse,
)
from gateway.wire.rules import RESPONSES_TOOL_CHOICE_RULE
from gateway.wire.tool_specs import NAME_PATTERN, StrictModel


class InputText(StrictModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Annotated[Any, refuse([])] = None


def _joined(content: str | Sequence[InputText | OutputTextPart]) -> str:
    """An item's text: a string as it is, parts one to a line."""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None  # the namespace tool the function belongs to
    id: str | None = None
    status: str | None = None


class OutputTextPart(StrictModel):
    type: Literal["input_text", "output_text"]
    text: str


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[OutputTextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return _joined(self.output)


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem,
                      Field(discriminator="type")]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(StrictModel):
    """Functions grouped under a name: the model sees each as ``<namespace>__<name>``,
    and its calls come back as ``name`` and ``namespace``."""

    type: Literal["namespace"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    tools: list[FunctionTool] = Field(min_length=1, max_length=128)


MAX_NAME = 64  # a function name's longest (``NAME_PATTERN``)

# Tools OpenAI runs on its side, which this server cannot: accepted, left out of what the
# model sees, echoed in the response's ``tools`` and named in its ``ignored_tools``.
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_preview_2025_03_11",
                "web_search_2025_08_26", "file_search", "code_interpreter", "computer_use",
                "computer_use_preview", "image_generation", "mcp")


class HostedTool(BaseModel):
    """A hosted tool, with whatever options it came with (kept for the echo)."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)
    type: Literal[HOSTED_TOOLS]  # type: ignore[valid-type]


ResponsesTool = Annotated[FunctionTool | NamespaceTool | HostedTool,
                          Field(discriminator="type")]


def flat_name(namespace: str, name: str) -> str:
    """The one name the model sees for a namespace's function: ``<namespace>__<name>``
    (underscores at the seam trimmed, so ``mcp__files__`` and ``read`` give
    ``mcp__files__read``); past a function name's 64 characters, its first 55 and a hash
    of the whole."""
    flat = f"{namespace.rstrip('_')}__{name.lstrip('_')}"
    if len(flat) <= MAX_NAME:
        return flat
    return f"{flat[:MAX_NAME - 9]}_{hashlib.sha1(flat.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class FunctionNames:
    """Each function the model sees, by the name it sees: its namespace (None for a
    plain function) and its own name."""

    by_flat: dict[str, tuple[str | None, str]]

    def split(self, flat: str) -> tuple[str | None, str]:
        return self.by_flat.get(flat, (None, flat))

    @staticmethod
    def flat(namespace: str | None, name: str) -> str:
        return name if namespace is None else flat_name(namespace, name)


class ReasoningOptions(StrictModel):
    """Accepted; the served models do not reason apart from their answer, so there are
    no reasoning items and no reasoning tokens."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


# What ``include`` may ask for. Each names output this server never produces (reasoning
# items, hosted tools' calls, input images), so each adds nothing; log probabilities are
# refused.
INCLUDABLE = ("reasoning.encrypted_content", "web_search_call.action.sources",
              "web_search_call.results", "file_search_call.results",
              "code_interpreter_call.outputs", "computer_call_output.output.image_url",
              "message.input_image.image_url")


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str


class TextFormatSpec(StrictModel):
    # ``ResponsesRequest._check``'s rule, for /openapi.json
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, json_schema_extra={
        "allOf": [{"if": {"properties": {"type": {"const": "json_schema"}},
                          "required": ["type"]},
                   "then": {"required": ["name", "schema"],
                            "properties": {"name": {"type": "string"},
                                           "schema": {"type": "object"}}}}]})

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(StrictModel):
    format: TextFormatSpec | None = None
    verbosity: Annotated[Any, refuse("medium")] = None


def _input(value: Any) -> Any:
    """A message without ``type`` is a message item (as OpenAI accepts)."""
    if isinstance(value, list):
        return [dict(v, type="message") if isinstance(v, dict) and "type" not in v else v
                for v in value]
    return value


def _input_value(value: Any) -> Any:
    """A non-empty string or item list; refused by name otherwise (not by union member)."""
    if isinstance(value, str | list) and value:
        return value
    raise PydanticCustomError("invalid_value", "input must be a non-empty string or a "
                              "non-empty array of input items")


class ResponsesRequest(StrictModel):
    """``POST /v1/responses``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True,
                              json_schema_extra={"allOf": [RESPONSES_TOOL_CHOICE_RULE]})
    model: str
    input: Annotated[Annotated[str, Field(min_length=1)]
                     | Annotated[list[InputItem], Field(min_length=1)],
                     BeforeValidator(_input_value)]
    instructions: str | None = None
    max_output_tokens: OptionalInt = Field(default=None, ge=1)
    parallel_tool_calls: bool | None = None
    previous_response_id: Annotated[Any, refuse()] = None
    store: Annotated[Any, refuse(False)] = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    text: TextOptions | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = Field(
        default=None, description="A named function must be one of tools (a namespace's by "
        "its flat name, <namespace>__<name>; refused otherwise).")
    tools: list[ResponsesTool] | None = Field(
        default=None, max_length=128,
        description="Function names must be unique, a namespace's functions counted by their "
        "flat names, <namespace>__<name> (a request that repeats one is refused).")
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    user: str | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16)
    include: list[Literal[INCLUDABLE]] | None = None  # type: ignore[valid-type]
    reasoning: ReasoningOptions | None = None
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None  # accepted, not used
    truncation: Annotated[Any, refuse("disabled")] = None
    background: Annotated[Any, refuse(False)] = None
    # -- extras (not in OpenAI's API) ----------------------------------------------------
    speculation: SpeculationOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _typed_items(cls, data: Any) -> Any:
        if isinstance(data, dict) and "input" in data:
            return {**data, "input": _input(data["input"])}
        return data

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        spec = self.text.format if self.text is not None else None
        if spec is not None and spec.type == "json_schema" and (
                spec.name is None or spec.schema_ is None):
            raise PydanticCustomError("invalid_value", "a json_schema format needs a name "
                                      "and a schema", {"param": "text.format"})
        forcing = self.tool_choice is not None and self.tool_choice not in ("none", "auto")
        if forcing and not self.functions():  # RESPONSES_TOOL_CHOICE_RULE
            raise invalid_value("tool_choice", "this tool_choice needs a function or namespace "
                                "tool (hosted tools are not run here)")
        return self

    def hosted_tools(self) -> list[str]:
        """The hosted tools' types, in order, each once (left out of the prompt)."""
        kinds = [t.type for t in self.tools or () if isinstance(t, HostedTool)]
        return list(dict.fromkeys(kinds))

    def functions(self) -> list[tuple[str | None, FunctionTool]]:
        """Every function the model may call, with its namespace (None: a plain one)."""
        out: list[tuple[str | None, FunctionTool]] = []
        for tool in self.tools or ():
            if isinstance(tool, FunctionTool):
                out.append((None, tool))
            elif isinstance(tool, NamespaceTool):
                out.extend((tool.name, f) for f in tool.tools)
        return out

    def function_names(self) -> FunctionNames:
        return FunctionNames({FunctionNames.flat(ns, f.name): (ns, f.name)
                              for ns, f in self.functions()})

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion (validated as one)."""
        body: dict[str, Any] = {
            "model": self.model, "messages": self._messages(),
            "max_completion_tokens": self.max_output_tokens, "stream": bool(self.stream),
            "temperature": self.temperature, "top_p": self.top_p, "user": self.user,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        functions = self.functions()
        if functions:
            body["tools"] = [{"type": "function", "function": {
                **f.model_dump(exclude={"type"}, exclude_none=True),
                "name": FunctionNames.flat(ns, f.name)}} for ns, f in functions]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = choice if isinstance(choice, str) else {
                "type": "function", "function": {"name": choice.name}}
        spec = self.text.format if self.text is not None else None
        if spec is not None and spec.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": spec.name, "schema": spec.schema_, "strict": bool(spec.strict)}}
        elif spec is not None:
            body["response_format"] = {"type": spec.type}
        if self.speculation is not None:
            body["speculation"] = self.speculation.model_dump()
        return ChatCompletionRequest.model_validate(body)

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(
            self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": item.text()})
            else:
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": FunctionNames.flat(item.namespace, item.name),
                                     "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return messages
