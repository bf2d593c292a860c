"""Prompt lookup: propose what followed the latest earlier occurrence of the
sequence's last n tokens. No model, nearly free, strong on input-grounded tasks
(rewriting, editing, summarising a passage given in the prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decoding.drafters.base import BaseDrafter, DraftContext, DraftProposal

DEFAULT_MAX_NGRAM = 4
DEFAULT_MIN_NGRAM = 2


@dataclass
class NgramState:
    # index[n][ngram] = position right after the latest earlier occurrence of ngram
    index: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0  # positions [0, indexed) have been entered


class NgramDrafter(BaseDrafter[NgramState]):
    name = "ngram"

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def begin(self, prompt_ids: Sequence[int]) -> NgramState:
        return NgramState(index={n: {} for n in range(self.min_ngram, self.max_ngram + 1)})

    def propose(self, state: NgramState, context: DraftContext, k: int) -> DraftProposal:
        tokens = context.token_ids
        self._index_up_to(state, tokens, len(tokens))
        if k <= 0:
            return DraftProposal.empty()
        length = len(tokens)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if length < n:
                continue
            start = state.index[n].get(tuple(tokens[length - n :]))
            if start is not None:
                # A match inside the recent output means the text repeats with period
                # length - start; continue the repetition past the end of what exists.
                period = length - start
                return DraftProposal(tokens=tuple(tokens[start + i % period] for i in range(k)))
        return DraftProposal.empty()

    def rollback(self, state: NgramState, length: int) -> None:
        if length < state.indexed:  # committed tokens never shrink; rebuild if they do
            state.index = {n: {} for n in state.index}
            state.indexed = 0

    def release(self, state: NgramState) -> None:
        state.index.clear()

    def _index_up_to(self, state: NgramState, tokens: Sequence[int], end: int) -> None:
        # An n-gram ending right before position p is entered once token p exists,
        # so the sequence's own suffix never matches itself.
        for p in range(max(state.indexed, 1), end):
            for n, table in state.index.items():
                if p >= n:
                    table[tuple(tokens[p - n : p])] = p
        state.indexed = max(state.indexed, end)
