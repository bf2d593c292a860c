"""Per-choice accounting: what each choice of a request has produced so far, and what
the API reports of it (usage, finish reason, speculation statistics, the error a final
round event stands for). The formats and the request's run read it; it runs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decoding.types import FinishReason, RoundEvent
from gateway.wire.bodies import (
    CompletionTokensDetails,
    PromptTokensDetails,
    SpeculationStats,
    Usage,
)
from gateway.wire.errors import (
    APIError,
    GenerationTimeoutError,
    InternalError,
    ServiceUnavailableError,
)


@dataclass(frozen=True)
class Ended:
    """A choice's stream closed; ``finished`` says whether it saw its final event."""

    finished: bool


@dataclass
class ChoiceTotals:
    """What one choice has produced so far."""

    drafter: str | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    finish_reason: FinishReason | None = None
    error: APIError | None = None
    text: list[str] = field(default_factory=list)
    prediction: Sequence[int] = ()  # the request's predicted output, as token ids
    token_ids: list[int] = field(default_factory=list)  # committed so far (with a prediction)
    predicted: int | None = None  # the prediction's tokens in the answer, once it ended

    def add(self, event: RoundEvent) -> None:
        self.prompt_tokens = event.prompt_tokens or self.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
        self.completion_tokens = max(self.completion_tokens, event.completion_tokens)
        if event.token_ids:
            self.rounds += 1
        self.drafted += event.draft_tokens
        self.accepted += event.accepted_tokens
        self.text.append(event.text)
        if self.prediction:
            self.token_ids.extend(event.token_ids)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.error = event_error(event)
            if self.prediction:
                self.predicted = common_length(self.prediction, self.token_ids)

    def end(self, ended: Ended) -> None:
        if not ended.finished and self.error is None:
            self.error = ServiceUnavailableError(
                "The request was cancelled because the server is shutting down.",
                code="shutting_down")

    def stats(self) -> SpeculationStats:
        return SpeculationStats.of(self.drafter, self.rounds, self.drafted, self.accepted)


def event_error(event: RoundEvent) -> APIError | None:
    """The API error a final event stands for, if any."""
    reason = event.finish_reason
    if reason is FinishReason.TIMEOUT:
        return GenerationTimeoutError("The request ran past the server's time limit.")
    if reason is FinishReason.ERROR:
        return InternalError(event.error or "The model failed on this request.",
                             code="generation_error")
    if reason is FinishReason.CANCELLED:
        return ServiceUnavailableError(
            "The request was cancelled because the server is shutting down.",
            code="shutting_down")
    return None


def finish_reason_text(reason: FinishReason | None) -> str | None:
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        return reason.value
    return None


def usage_of(totals: Sequence[ChoiceTotals], per_prompt: int) -> Usage:
    """Prompt tokens count once per prompt (not per choice), as OpenAI does. Of a
    prediction, each choice counts the tokens its answer holds (in order, as a diff
    aligns two texts) as accepted and the others as rejected, and the rejected count as
    completion tokens, as OpenAI's do (a choice that has not ended counts none yet)."""
    prompt = sum(t.prompt_tokens for t in totals[::per_prompt])
    cached = sum(t.cached_tokens for t in totals[::per_prompt])
    accepted = sum(t.predicted for t in totals if t.predicted is not None)
    rejected = sum(len(t.prediction) - t.predicted for t in totals if t.predicted is not None)
    completion = sum(t.completion_tokens for t in totals) + rejected
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                 completion_tokens_details=CompletionTokensDetails(
                     accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected))


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common subsequence of ``a`` and ``b``: the tokens a diff
    of the two keeps. Bit-parallel (Allison and Dix, 1986; Hyyro, 2004): a bit per item
    of ``a``, one pass of integer arithmetic per item of ``b``, so 8k tokens against 8k
    take milliseconds where the textbook table takes 64 M steps."""
    masks: dict[int, int] = {}
    for i, item in enumerate(a):
        masks[item] = masks.get(item, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full  # a zero bit per item of ``a`` matched so far
    for item in b:
        u = v & masks.get(item, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - v.bit_count()


def speculation_of(totals: Sequence[ChoiceTotals]) -> SpeculationStats:
    """The request's speculation statistics, over all its choices."""
    return SpeculationStats.total([t.stats() for t in totals])
