"""Request models for structured outputs and tools: ``response_format``, ``tools``,
``tool_choice`` and the tool calls an assistant message carries back, in OpenAI's
shapes (chat completions; the Responses API reuses the function definition)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

NAME_PATTERN = r"^[a-zA-Z0-9_.\-]{1,64}$"
MAX_TOOLS = 128


class StrictModel(BaseModel):
    """A request model that refuses unknown fields and values of another JSON type."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True,
                              populate_by_name=True)


class TextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaSpec(StrictModel):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = False


class JsonSchemaFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                           Field(discriminator="type")]


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(StrictModel):
    """A tool call an assistant message carries back from an earlier response."""

    id: str
    type: Literal["function"]
    function: FunctionCall
