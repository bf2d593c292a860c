"""Prompt lookup: propose what followed an earlier occurrence of the sequence's last n
tokens. No model, nearly free, strong on input-grounded tasks (rewriting, editing,
summarising a passage given in the prompt) and above all on code edits, whose answers
copy most of the code they were given.

Of the earlier occurrences of the longest n-gram, the one whose preceding tokens agree
longest with the sequence's own (up to ``CONTEXT_MATCH`` tokens back) is followed, the
latest among equals: code repeats short n-grams everywhere (an indentation and a
keyword, ``self.``), and the occurrence that shares the most context is the one being
copied. Shorter n-grams fall back to their latest occurrence. A draft runs no further
ahead than its match agrees behind (at least ``SHORTEST_RUN`` tokens): a copy that has
agreed for 20 tokens is likely to go on for about as many, one that agrees on an n-gram
alone is as likely to part at once (replayed on the code-edit tuning answers: 2-6%
faster than drafting as far as the policy allows; docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decoding.drafter import BaseDrafter, DraftContext, DraftProposal

DEFAULT_MAX_NGRAM = 4
DEFAULT_MIN_NGRAM = 2
CANDIDATES = 16  # the latest occurrences of an n-gram of the longest size kept to choose from
CONTEXT_MATCH = 32  # tokens back that an occurrence's context is compared over
SHORTEST_RUN = 2  # the fewest tokens a match drafts, however short its agreement


@dataclass
class NgramState:
    # index[n][ngram] = position right after the latest earlier occurrence of ngram
    index: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    # the longest n-grams' latest CANDIDATES occurrences (positions right after), oldest first
    occurrences: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    indexed: int = 0  # positions [0, indexed) have been entered


class NgramDrafter(BaseDrafter[NgramState]):
    name = "ngram"

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM,
                 context_match: int = CONTEXT_MATCH):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.context_match = context_match

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
            key = tuple(tokens[length - n :])
            agree = n
            if n == self.max_ngram:
                found = state.occurrences.get(key)
                start, agree = self._closest(tokens, found, n) if found else (None, n)
            else:
                start = state.index[n].get(key)
            if start is not None:
                # A match inside the recent output means the text repeats with period
                # length - start; continue the repetition past the end of what exists.
                period = length - start
                run = min(k, max(agree, SHORTEST_RUN))
                return DraftProposal(tokens=tuple(tokens[start + i % period]
                                                  for i in range(run)))
        return DraftProposal.empty()

    def _closest(self, tokens: Sequence[int], found: list[int], n: int) -> tuple[int, int]:
        """Of the occurrences ``found`` (positions right after an n-gram equal to the
        sequence's last ``n`` tokens), the one whose preceding tokens agree with the
        sequence's own the longest, the latest among equals; and how far it agrees."""
        end = len(tokens)
        best, best_agree = found[-1], -1
        for start in reversed(found):
            agree = n
            while (agree < self.context_match and start - 1 - agree >= 0
                   and tokens[start - 1 - agree] == tokens[end - 1 - agree]):
                agree += 1
            if agree > best_agree:
                best, best_agree = start, agree
        return best, best_agree

    def rollback(self, state: NgramState, length: int) -> None:
        if length < state.indexed:  # committed tokens never shrink; rebuild if they do
            state.index = {n: {} for n in state.index}
            state.occurrences = {}
            state.indexed = 0

    def release(self, state: NgramState) -> None:
        state.index.clear()
        state.occurrences.clear()

    def _index_up_to(self, state: NgramState, tokens: Sequence[int], end: int) -> None:
        # An n-gram ending right before position p is entered once token p exists,
        # so the sequence's own suffix never matches itself.
        longest = self.max_ngram
        for p in range(max(state.indexed, 1), end):
            for n, table in state.index.items():
                if p >= n:
                    key = tuple(tokens[p - n : p])
                    table[key] = p
                    if n == longest:
                        seen = state.occurrences.setdefault(key, [])
                        seen.append(p)
                        if len(seen) > CANDIDATES:
                            del seen[0]
        state.indexed = max(state.indexed, end)
