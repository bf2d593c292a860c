"""The Response object and the typed stream events of ``POST /v1/responses``, as
/openapi.json documents them (gateway/api/responses.py builds them).

A stream is ``event: <type>`` / ``data: <event>`` pairs, the event's ``type`` equal
to its ``event:`` line and ``sequence_number`` counting from 0; it begins with
``response.created`` and ends with ``response.completed``, ``response.incomplete``
or ``response.failed``. There is no ``data: [DONE]``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.wire.bodies import SpeculationStats

ItemStatus = Literal["in_progress", "completed", "incomplete"]
END_EVENTS = ("response.completed", "response.incomplete", "response.failed")


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OutputText(_Out):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class OutputMessage(_Out):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(_Out):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str  # a namespace tool's function: its own name, and ``namespace`` set
    arguments: str
    status: ItemStatus
    namespace: str | None = None


OutputItem = Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(_Out):
    cached_tokens: int


class OutputTokensDetails(_Out):
    reasoning_tokens: int


class ResponseUsage(_Out):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class ResponseError(_Out):
    code: str
    message: str


class Reasoning(_Out):
    effort: str | None
    summary: str | None


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Out):
    """The Response object: the body of a whole response, and inside lifecycle events."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None
    model: str
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None
    store: Literal[False]
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any] | None
    tools: list[dict[str, Any]]
    usage: ResponseUsage | None
    metadata: dict[str, str]
    prompt_cache_key: str | None
    reasoning: Reasoning
    # -- extras (not in OpenAI's API) ----------------------------------------------------
    speculation: SpeculationStats | None
    ignored_tools: list[str]  # hosted tools' types, left out of what the model saw


class _Event(_Out):
    sequence_number: int = Field(ge=0)


class ResponseLifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed",
                  "response.incomplete", "response.failed"]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str


class OutputTextDoneEvent(_Event):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    arguments: str


EVENT_MODELS: tuple[type[BaseModel], ...] = (
    ResponseLifecycleEvent, OutputItemEvent, ContentPartEvent, OutputTextDeltaEvent,
    OutputTextDoneEvent, FunctionCallArgumentsDeltaEvent, FunctionCallArgumentsDoneEvent)


def event_types() -> list[str]:
    """Every event ``type`` a stream may send."""
    out: list[str] = []
    for model in EVENT_MODELS:
        out.extend(model.model_fields["type"].annotation.__args__)  # type: ignore[union-attr]
    return out
