"""Several drafters at once: each proposes, the longest proposal wins.

Only deterministic drafters combine (n-gram lookup, continuations), plus at
most one model drafter, which is consulted last and only when the cheap ones
found nothing, so its cost is paid only when needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from decoding.drafters.base import DraftContext, Drafter, DraftProposal


class CombinedDrafter:
    def __init__(self, cheap: Sequence[Drafter], model: Drafter | None = None) -> None:
        if not cheap and model is None:
            raise ValueError("CombinedDrafter needs at least one drafter")
        self.cheap = list(cheap)
        self.model = model
        self.name = "+".join(d.name for d in [*self.cheap, *([model] if model else [])])

    def begin(self, prompt_ids: Sequence[int]) -> list[Any]:
        return [d.begin(prompt_ids) for d in self._all()]

    def propose(self, state: list[Any], context: DraftContext, k: int) -> DraftProposal:
        best = DraftProposal.empty()
        for drafter, sub in zip(self.cheap, state, strict=False):
            proposal = drafter.propose(sub, context, k)
            if len(proposal.tokens) > len(best.tokens):
                best = proposal
        if self.model is not None and not best.tokens:
            best = self.model.propose(state[-1], context, k)
        return best

    def rollback(self, state: list[Any], length: int) -> None:
        for drafter, sub in zip(self._all(), state, strict=True):
            drafter.rollback(sub, length)

    def release(self, state: list[Any]) -> None:
        for drafter, sub in zip(self._all(), state, strict=True):
            drafter.release(sub)

    def _all(self) -> list[Drafter]:
        return [*self.cheap, *([self.model] if self.model is not None else [])]
