"""Continuation drafts: tokens that followed the same context before.

A request that repeats earlier work (a regenerated answer, a retried request,
the same question from another user) gets the earlier continuation as free
drafts, verified by the target like any draft. No model runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding.drafter import BaseDrafter, DraftContext, DraftProposal
from decoding.prefix_cache import PrefixCache


class ContinuationDrafter(BaseDrafter[None]):
    name = "cache"

    def __init__(self, cache: PrefixCache, vocab_size: int) -> None:
        self.cache = cache
        self.vocab_size = vocab_size

    def begin(self, prompt_ids: Sequence[int]) -> None:
        return None

    def propose(self, state: None, context: DraftContext, k: int) -> DraftProposal:
        if k <= 0:
            return DraftProposal.empty()
        tokens = self.cache.continuation(context.token_ids)[:k]
        if any(not 0 <= t < self.vocab_size for t in tokens):
            return DraftProposal.empty()
        return DraftProposal(tokens=tuple(tokens))

    def rollback(self, state: None, length: int) -> None:
        pass

    def release(self, state: None) -> None:
        pass
