"""Per-round figures for stream chunks: what each round drafted and kept, and where
each character of the chunk's text came from.

Every streamed chunk carries its choice's running totals and its round in the
``speculation`` extra (see docs/api.md), so that a client can colour the text by
origin: the accepted drafts of a round by the source that drafted them
(``lookup``, ``cache``, ``model``, ``prediction``: the request's own predicted output)
and the rest by ``target`` (the token verification
takes from the target itself: recovered or bonus).
"""

from __future__ import annotations

from typing import Any, Literal

from decoding.text import text_decoder
from decoding.types import RoundEvent
from gateway.wire.bodies import RoundInfo, SpeculationStats, StreamSpeculation

TARGET = "target"  # a token the target produced itself
PROMPT = "prompt"  # echoed prompt text (legacy completions with echo)
ANCHOR_CONTEXT = 8  # tokens decoded before a round's start, so word boundaries come out right
LOOKUP_SOURCES = frozenset({"lookup", "ngram"})  # a combined drafter's cheap sources, n-gram


Source = Literal["lookup", "cache", "model", "prediction", "none"]


def source_kind(draft_source: str) -> Source:
    """The kind of drafter behind a round's ``draft_source``: a combined drafter names
    ``lookup`` (n-gram or continuation cache, whichever proposed longer) or ``model``;
    a single drafter names itself (``ngram``, ``cache``, or a draft model's name); a
    request's prediction names ``prediction``."""
    if not draft_source:
        return "none"
    if draft_source == "prediction":
        return "prediction"
    if draft_source in LOOKUP_SOURCES:
        return "lookup"
    if draft_source == "cache":
        return "cache"
    return "model"


class TextOrigins:
    """One choice's text, split by origin: the decoded length of its tokens at the end
    of each round's accepted drafts and of the round, and how much has been sent."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decode = text_decoder(tokenizer)
        self.token_ids: list[int] = []
        self.segments: list[tuple[int, str]] = []  # (end offset in the text, origin)
        self.sent = 0  # characters of text sent so far
        self._anchor = (0, 0)  # (tokens, their text's length) at the end of the last round

    def _decoded(self, start: int, stop: int) -> int:
        return len(self._decode(self.token_ids[start:stop]))

    def _length(self, count: int) -> int:
        """The text length of the first ``count`` tokens, decoding only a window from a
        few tokens before the last round's end (a whole-text decode per round would make
        a long answer quadratic)."""
        tokens, length = self._anchor
        start = max(0, tokens - ANCHOR_CONTEXT)
        return length + self._decoded(start, count) - self._decoded(start, tokens)

    def add(self, event: RoundEvent, kind: str) -> None:
        """Account for one round's committed tokens: the first ``accepted_tokens`` were
        drafted by ``kind``, the rest came from the target."""
        if not event.token_ids:
            return
        start = len(self.token_ids)
        self.token_ids.extend(event.token_ids)
        accepted = min(event.accepted_tokens, len(event.token_ids))
        if accepted:
            self.segments.append((self._length(start + accepted), kind))
        if accepted < len(event.token_ids):
            self.segments.append((self._length(len(self.token_ids)), TARGET))
        self._anchor = (len(self.token_ids), self.segments[-1][0])

    def spans(self, text: str) -> list[tuple[int, str]]:
        """``[(characters, origin), ...]`` covering ``text``, the next text sent, in
        order; characters are Unicode code points."""
        begin, end = self.sent, self.sent + len(text)
        self.sent = end
        spans: list[tuple[int, str]] = []
        position = begin
        for stop, origin in self.segments:
            if stop <= position:
                continue
            take = min(stop, end) - position
            if take > 0:
                _append(spans, take, origin)
                position += take
            if position >= end:
                break
        if position < end:  # text the token lengths did not foresee (a rewriting tokenizer)
            _append(spans, end - position, TARGET)
        return spans


def _append(spans: list[tuple[int, str]], length: int, origin: str) -> None:
    if spans and spans[-1][1] == origin:
        spans[-1] = (spans[-1][0] + length, origin)
    else:
        spans.append((length, origin))


def stream_speculation(event: RoundEvent, totals: SpeculationStats,
                       spans: list[tuple[int, str]]) -> StreamSpeculation:
    """The ``speculation`` extra of one stream chunk: running totals and this round."""
    timing = event.timing
    info = RoundInfo(
        index=event.round_index, source=source_kind(event.draft_source),
        draft_tokens=event.draft_tokens, accepted_tokens=event.accepted_tokens,
        tokens=len(event.token_ids), draft_ms=round(timing.draft_s * 1000, 3),
        verify_ms=round(timing.verify_s * 1000, 3), batch_size=event.batch_size,
        spans=[[n, origin] for n, origin in spans],
    )
    return StreamSpeculation(**totals.model_dump(), round=info)
