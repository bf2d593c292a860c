"""Engine events as OpenAI JSON: chat (``chat.completion`` / ``chat.completion.chunk``)
and legacy completions (``text_completion``), streamed or whole, and the ``Format``
protocol every encoder meets (the Responses API's is ``gateway.encode.responses``).

Stream framing: ``data: {chunk}`` per round of any choice (interleaved, each with its
``index``), the usage chunk (``choices: []``) when ``stream_options.include_usage`` is
set, then ``data: [DONE]``. A failure after the stream began (timeout, model error,
shutdown) is sent as ``data: {"error": {...}}`` and the stream ends without ``[DONE]``.

A format keeps per-choice state (first chunk sent, running ``text_offset``,
accumulated logprobs) for one API request.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from decoding.types import RoundEvent, TokenLogprob
from gateway.decode.plan import Job
from gateway.encode.speculation import PROMPT, TextOrigins, source_kind, stream_speculation
from gateway.encode.token_texts import (
    LegacyLogprobs,
    TokenTexts,
    chat_logprobs,
    merge_legacy,
    visible,
)
from gateway.encode.totals import ChoiceTotals, finish_reason_text, speculation_of, usage_of
from gateway.wire.bodies import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    StreamSpeculation,
)
from gateway.wire.errors import APIError

Sent = str | dict[str, str]  # one SSE event's data, or an event sse-starlette sends as it is
DONE = "[DONE]"
_DROP_WHEN_NONE = ("usage", "speculation", "seed")


def chunk_json(chunk: BaseModel) -> str:
    """A chunk as compact JSON, without null extras or null delta fields."""
    data = chunk.model_dump(mode="json")
    for key in _DROP_WHEN_NONE:
        if data.get(key) is None:
            data.pop(key, None)
    for choice in data.get("choices", ()):
        delta = choice.get("delta")
        if isinstance(delta, dict):
            choice["delta"] = {k: v for k, v in delta.items() if v is not None}
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


class Format(Protocol):
    """The encoder of one output shape: how a request's answer is written, as a stream
    (what each step of the run's one loop sends) or as one body. Chat chunks, completion
    chunks and the Responses API's typed events are each one."""

    def opening(self) -> list[Sent]:
        """What a stream sends at once, before the prompt is read."""
        ...

    def round(self, index: int, event: RoundEvent, totals: ChoiceTotals) -> list[Sent]:
        """What one round of one choice sends (nothing when it adds nothing)."""
        ...

    def idle(self) -> list[Sent]:
        """What a stream sends while no round comes (a queued request, a long prompt)."""
        ...

    def failure(self, error: APIError, totals: ChoiceTotals) -> list[Sent]:
        """The stream's last event, when a choice failed after streaming began."""
        ...

    def closing(self, totals: Sequence[ChoiceTotals]) -> list[Sent]:
        """The events that end a stream whose choices all finished."""
        ...

    def observe(self, index: int, event: RoundEvent) -> None:
        """Remember one round for the whole response."""
        ...

    def response(self, totals: Sequence[ChoiceTotals]) -> BaseModel:
        """The whole answer, once every choice finished."""
        ...

    def tool_calls(self) -> int:
        """Tool calls the answers have made so far."""
        ...


BodyT = TypeVar("BodyT", ChatCompletionChunk, ChatCompletion, Completion)


class _ChoiceFormat(ABC):
    """What both formats keep per choice: whether it has started streaming."""

    def __init__(self, job: Job, texts: TokenTexts, hidden_ids: frozenset[int]) -> None:
        self.job = job
        self.texts = texts
        self.hidden_ids = hidden_ids
        self.count = len(job.prompts) * job.per_prompt
        self._started = [False] * self.count
        self._origins = [TextOrigins(texts.tokenizer) for _ in range(self.count)]

    def tool_calls(self) -> int:
        return 0  # plain chat and completions call no tools (gateway/encode/tool_calls.py does)

    # -- the stream: OpenAI chunks as JSON, then ``[DONE]`` --------------------------------

    def opening(self) -> list[Sent]:
        return [chunk_json(c) for c in self.opening_chunks()]

    def round(self, index: int, event: RoundEvent, totals: ChoiceTotals) -> list[Sent]:
        chunk = self.chunk(index, event, totals)
        return [] if chunk is None else [chunk_json(chunk)]

    def idle(self) -> list[Sent]:
        return [chunk_json(self.heartbeat())]

    def failure(self, error: APIError, totals: ChoiceTotals) -> list[Sent]:
        return [json.dumps(error.body())]

    def closing(self, totals: Sequence[ChoiceTotals]) -> list[Sent]:
        usage = [chunk_json(self.usage_chunk(totals))] if self.job.usage else []
        return [*usage, DONE]

    def opening_chunks(self) -> Sequence[BaseModel]:
        """The chunks sent at once (chat: each choice's role)."""
        return []

    @abstractmethod
    def heartbeat(self) -> BaseModel:
        """An empty chunk."""

    @abstractmethod
    def chunk(self, index: int, event: RoundEvent, totals: ChoiceTotals) -> BaseModel | None:
        """The chunk for one round of one choice (None when it adds nothing)."""

    @abstractmethod
    def usage_chunk(self, totals: Sequence[ChoiceTotals]) -> BaseModel:
        """The stream's usage chunk (``stream_options.include_usage``)."""

    def _round(self, index: int, event: RoundEvent) -> None:
        """Account for a streamed round's tokens (before deciding whether it is sent)."""
        self._origins[index].add(event, source_kind(event.draft_source))

    def _speculation(self, index: int, event: RoundEvent, totals: ChoiceTotals, text: str,
                     echoed: int = 0) -> StreamSpeculation:
        spans = self._origins[index].spans(text[echoed:])
        return stream_speculation(event, totals.stats(),
                                  [(echoed, PROMPT), *spans] if echoed else spans)

    def _body(self, kind: type[BodyT], choices: list[Any], **extras: Any) -> BodyT:
        """A body or chunk of the job: its id, time, model and seed, with these choices."""
        return kind(id=self.job.id, created=self.job.created, model=self.job.model,
                    choices=choices, seed=self.job.seed, **extras)

    def _usage(self, kind: type[BodyT], totals: Sequence[ChoiceTotals]) -> BodyT:
        """The stream's last chunk, when asked for: no choices, the request's usage."""
        return self._body(kind, [], usage=usage_of(totals, self.job.per_prompt),
                          speculation=speculation_of(totals))

    def _shown_logprobs(self, event: RoundEvent) -> Sequence[TokenLogprob]:
        """The round's logprobs, without the final EOS token the text never shows."""
        return visible(event.logprobs, self.hidden_ids) if event.finished else event.logprobs


class ChatFormat(_ChoiceFormat):
    def __init__(self, job: Job, texts: TokenTexts, hidden_ids: frozenset[int]) -> None:
        super().__init__(job, texts, hidden_ids)
        self._logprobs: list[list[dict[str, Any]]] = [[] for _ in range(self.count)]

    def _logprobs_of(self, event: RoundEvent) -> list[dict[str, Any]]:
        return chat_logprobs(self.texts, self._shown_logprobs(event))

    def _chunk(self, index: int, delta: ChatDelta) -> ChatCompletionChunk:
        return self._body(ChatCompletionChunk, [ChatChunkChoice(index=index, delta=delta)])

    def opening_chunks(self) -> list[ChatCompletionChunk]:
        """Each choice's role, at once."""
        self._started = [True] * self.count
        return [self._chunk(i, ChatDelta(role="assistant", content=""))
                for i in range(self.count)]

    def heartbeat(self) -> ChatCompletionChunk:
        return self._chunk(0, ChatDelta())

    def chunk(self, index: int, event: RoundEvent, totals: ChoiceTotals
              ) -> ChatCompletionChunk | None:
        self._round(index, event)
        first = not self._started[index]
        content = self._logprobs_of(event) if self.job.logprobs else None
        finish = finish_reason_text(event.finish_reason)
        if not (first or event.text or content or finish):
            return None
        self._started[index] = True
        delta = ChatDelta(role="assistant" if first else None, content=event.text)
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish,
                                 logprobs={"content": content, "refusal": None}
                                 if content is not None else None)
        return self._body(ChatCompletionChunk, [choice],
                          speculation=self._speculation(index, event, totals, event.text))

    def observe(self, index: int, event: RoundEvent) -> None:
        if self.job.logprobs:
            self._logprobs[index].extend(self._logprobs_of(event))

    def usage_chunk(self, totals: Sequence[ChoiceTotals]) -> ChatCompletionChunk:
        return self._usage(ChatCompletionChunk, totals)

    def response(self, totals: Sequence[ChoiceTotals]) -> ChatCompletion:
        choices = [
            ChatChoice(
                index=i,
                message=ChatMessageOut(content="".join(t.text)),
                logprobs={"content": self._logprobs[i], "refusal": None}
                if self.job.logprobs else None,
                finish_reason=finish_reason_text(t.finish_reason),
            )
            for i, t in enumerate(totals)
        ]
        return self._body(ChatCompletion, choices, usage=usage_of(totals, self.job.per_prompt),
                          speculation=speculation_of(totals))


class CompletionFormat(_ChoiceFormat):
    def __init__(self, job: Job, texts: TokenTexts, hidden_ids: frozenset[int]) -> None:
        super().__init__(job, texts, hidden_ids)
        self._legacy = [
            LegacyLogprobs(texts, len(job.prompt_of(i).text) if job.echo else 0)
            for i in range(self.count)
        ]
        self._parts: list[list[dict[str, list[Any]]]] = [[] for _ in range(self.count)]
        self._scored = [False] * self.count  # the echoed prompt's logprobs have been given

    def _prefix(self, index: int) -> str:
        """The echoed prompt, once, before a choice's first text."""
        if self._started[index] or not self.job.echo:
            return ""
        return self.job.prompt_of(index).text

    def _logprobs_of(self, index: int, event: RoundEvent) -> dict[str, list[Any]]:
        """The round's entries; with ``echo``, the prompt's before the first round's, and a
        final end-of-sequence token kept: an echoed request lists every token it scored
        (lm-evaluation-harness drops the last entry as the generated one)."""
        legacy = self._legacy[index]
        completion = legacy.chunk(event.logprobs if self.job.echo
                                  else self._shown_logprobs(event))
        if not self.job.echo or self._scored[index]:
            return completion
        self._scored[index] = True
        prompt = legacy.prompt(self.job.prompt_of(index).ids[0], event.prompt_logprobs)
        return merge_legacy([prompt, completion])

    def heartbeat(self) -> Completion:
        return self._body(Completion, [CompletionChoice(text="", index=0, finish_reason=None)])

    def chunk(self, index: int, event: RoundEvent, totals: ChoiceTotals) -> Completion | None:
        self._round(index, event)
        echoed = self._prefix(index)
        text = echoed + event.text
        logprobs = self._logprobs_of(index, event) if self.job.logprobs else None
        finish = finish_reason_text(event.finish_reason)
        if not (text or (logprobs and logprobs["tokens"]) or finish):
            return None
        self._started[index] = True
        choice = CompletionChoice(
            text=text, index=index, finish_reason=finish,
            logprobs=CompletionLogprobs(**logprobs) if logprobs is not None else None)
        return self._body(Completion, [choice],
                          speculation=self._speculation(index, event, totals, text, len(echoed)))

    def observe(self, index: int, event: RoundEvent) -> None:
        if self.job.logprobs:
            self._parts[index].append(self._logprobs_of(index, event))

    def usage_chunk(self, totals: Sequence[ChoiceTotals]) -> Completion:
        return self._usage(Completion, totals)

    def response(self, totals: Sequence[ChoiceTotals]) -> Completion:
        choices = []
        for i, t in enumerate(totals):
            prefix = self.job.prompt_of(i).text if self.job.echo else ""
            choices.append(CompletionChoice(
                text=prefix + "".join(t.text), index=i,
                logprobs=CompletionLogprobs(**merge_legacy(self._parts[i]))
                if self.job.logprobs else None,
                finish_reason=finish_reason_text(t.finish_reason)))
        return self._body(Completion, choices, usage=usage_of(totals, self.job.per_prompt),
                          speculation=speculation_of(totals))
