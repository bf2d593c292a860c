"""OpenAI response bodies and stream chunks, plus the speculation statistics
every response carries in the extra top-level ``speculation`` field (and a sampled
request's seed in ``seed``), the error body, and the bodies of ``/health`` and
``/ready``.

Fields follow OpenAI's reference order; extras sit in one marked block.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # none: the models served do not reason apart from the answer
    # the prediction's tokens that appear in the answer (as a diff would align them), and
    # those that do not; the latter are counted in ``completion_tokens`` too, as OpenAI does
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class SpeculationStats(BaseModel):
    """Extra: how speculation went. ``accepted_tokens`` counts accepted drafts
    only (not the target's own token per round); the rate is accepted/drafted."""

    drafter: str | None
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None

    @classmethod
    def of(cls, drafter: str | None, rounds: int, drafted: int, accepted: int
           ) -> SpeculationStats:
        rate = round(accepted / drafted, 4) if drafted else None
        return cls(drafter=drafter, rounds=rounds, draft_tokens=drafted,
                   accepted_tokens=accepted, acceptance_rate=rate)

    @classmethod
    def total(cls, parts: list[SpeculationStats]) -> SpeculationStats:
        drafters = {p.drafter for p in parts}
        drafter = drafters.pop() if len(drafters) == 1 else None
        return cls.of(drafter, sum(p.rounds for p in parts), sum(p.draft_tokens for p in parts),
                      sum(p.accepted_tokens for p in parts))


class RoundInfo(BaseModel):
    """Extra, in stream chunks: the round that produced the chunk (docs/api.md)."""

    index: int  # the choice's round, from 0
    source: Literal["lookup", "cache", "model", "prediction", "none"]  # what drafted it
    # ("none": nothing; "prediction": the request's predicted output)
    draft_tokens: int  # proposed this round
    accepted_tokens: int  # of those, accepted
    tokens: int  # committed this round: the accepted drafts and the target's own token
    draft_ms: float
    verify_ms: float
    batch_size: int  # sequences in the forward pass that verified it
    # The chunk's text by origin, in order: [code points, "lookup" | "cache" | "model" |
    # "prediction" | "target" | "prompt"]; the counts add up to the text's length.
    spans: list[list[int | str]]


class StreamSpeculation(SpeculationStats):
    """Extra, in stream chunks: the choice's totals so far and the chunk's round."""

    round: RoundInfo | None = None


# -- chat ------------------------------------------------------------------------------


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None


class _Sparse(BaseModel):
    """Serialised without its null fields (stream deltas carry only what changed)."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionDelta(_Sparse):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Sparse):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class _Body(BaseModel):
    """What every chat and completions body and chunk carries, in OpenAI's order; each
    kind names its ``object`` and its choices (a whole chat body requires its usage and
    speculation)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: Usage | None = None
    # -- extras (not in OpenAI's API) ----------------------------------------------------
    speculation: StreamSpeculation | SpeculationStats | None = None
    seed: int | None = None  # what a sampled request sampled with (drawn if it gave none)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class ChatCompletion(_Body):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    speculation: SpeculationStats


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Body):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


# -- completions ----------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    """The legacy completions format: one entry per token in each list. With ``echo``
    the prompt's tokens come first, the first of them with null logprob and alternatives."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(_Body):
    """Also the streamed chunk: OpenAI uses ``text_completion`` for both."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


# -- models ---------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    # -- extras (not in OpenAI's API) ----------------------------------------------------
    max_model_len: int
    metadata: dict[str, Any]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- errors and probes ----------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's format (also the last event of a stream that failed)."""

    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class HealthFailure(BaseModel):
    status: Literal["failed"] = "failed"
    error: str  # why loading the models failed


class PrefixCacheHealth(BaseModel):
    """The prefix cache's store. An unreachable Redis leaves the server ready: the cache
    is optional, and every request is then a miss."""

    store: Literal["in-process", "redis"]
    reachable: bool
    url: str | None = None  # Redis's URL, without its password
    error: str | None = None  # why the last ping failed


class Readiness(BaseModel):
    status: Literal["ready"] = "ready"
    running: int  # requests being decoded
    waiting: int  # requests queued
    prefix_cache: PrefixCacheHealth | None = None  # absent when the cache is off


class NotReady(BaseModel):
    status: Literal["loading", "draining", "failed"]
