"""A sequence's drafting: its drafter, the source that drafts each round and each source's
draft-length policy (``SequenceDrafting``), and one round's draft as the round carries it
from drafting to verification (``Draft``: ``SequenceDecoder.propose`` makes it,
``round.verify_and_commit`` takes it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

import torch

from decoding.constrained import ConstrainedDraft
from decoding.drafter import DraftContext, Drafter, DraftProposal
from decoding.features import FeatureRows
from decoding.policy import AdaptiveSpeculation
from decoding.types import RoundTiming
from decoding.verify import Verdict

DraftStateT = TypeVar("DraftStateT")  # the drafter's per-sequence state


@dataclass(frozen=True)
class Draft:
    """One round's draft for one sequence, and what verification needs of it."""

    tokens: tuple[int, ...]  # [k]
    probs: torch.Tensor | None  # [k, vocab]; None for a deterministic drafter
    alternative: int | None  # a second candidate for tokens[0]'s place, verified beside it
    proposal: DraftProposal
    seconds: float  # spent drafting
    started: float  # when the round began
    policy: AdaptiveSpeculation | None  # the draft source's policy, told the outcome
    expected: float | None  # accepted drafts the policy expects of it (before the outcome)
    constrained: ConstrainedDraft | None = None  # the draft as a request's grammar left it

    def learn(self, verdict: Verdict, timing: RoundTiming) -> None:
        """Tell the draft source's policy how the round went: of its own drafts, not the
        tokens a grammar forced ahead of them."""
        if self.policy is None:
            return
        forced = self.constrained.forced if self.constrained is not None else 0
        self.policy.update(
            len(self.tokens) - forced, max(0, verdict.accepted - forced), timing.draft_s,
            timing.verify_s, self.proposal.confidence[forced : len(self.tokens) + 1],
            alternative=(self.proposal.alternative_confidence if self.alternative is not None
                         else None),
            alternative_taken=verdict.alternative_taken)


class SequenceDrafting(Generic[DraftStateT]):
    """One sequence's drafter and its state, the source that drafts the next round, each
    source's draft-length policy, and the target's feature rows where the drafter reads
    them. It is also the ``DraftJudge`` of the sequence's drafts: the drafting source's
    policy judges how far a round drafts."""

    def __init__(
        self,
        drafter: Drafter[DraftStateT],
        prompt_ids: Sequence[int],
        alternatives: bool,
        features: bool,
        policy: AdaptiveSpeculation | None = None,
        new_policy: Callable[[str], AdaptiveSpeculation] | None = None,
        max_draft_tokens: int | None = None,
    ) -> None:
        """``alternatives``: a round may verify an alternative for its first draft token.
        ``features``: keep the target's hidden states for the drafter. ``policy``: one
        draft-length policy for every source; else each source gets its own from
        ``new_policy(source)`` (default: a fresh one), at most ``max_draft_tokens`` long."""
        self.drafter = drafter
        # the drafter's state (None for a stateless drafter), dropped once released
        self.state: DraftStateT | None = drafter.begin(prompt_ids)
        self.alternatives = alternatives
        self.features = FeatureRows() if features else None  # the target's, by position
        self.policies: dict[str, AdaptiveSpeculation] = {}  # by draft source
        self.source = ""  # the source that drafts the next round
        self._chosen_for = -1  # the round it was chosen for
        self._shared_policy = policy
        self._new_policy = new_policy
        self._max_draft_tokens = max_draft_tokens

    @property
    def drafter_state(self) -> DraftStateT:
        """What the drafter's calls take: the state it began with (None for a stateless
        drafter, and once released)."""
        return cast(DraftStateT, self.state)

    @property
    def policy(self) -> AdaptiveSpeculation:
        """The draft-length policy of the source that drafts the next round."""
        policy = self.policies.get(self.source)
        if policy is None:
            policy = self._shared_policy or (
                self._new_policy(self.source) if self._new_policy else AdaptiveSpeculation())
            if self._max_draft_tokens is not None:
                policy.max_tokens = min(policy.max_tokens, self._max_draft_tokens)
            self.policies[self.source] = policy
        return policy

    def choose_source(self, round_index: int, context: Callable[[], DraftContext]) -> None:
        """Let the drafter say which of its sources drafts round ``round_index`` (once per
        round); ``policy`` is then that source's."""
        if self._chosen_for == round_index:
            return
        self.source = self.drafter.source(self.drafter_state, context())
        self._chosen_for = round_index

    @property
    def source_name(self) -> str:
        """What an event names as its draft's source: the source, or the drafter's name."""
        return self.source or self.drafter.name

    def propose(self, context: DraftContext, k: int) -> DraftProposal:
        return self.drafter.propose(self.drafter_state, context, k)

    def rollback(self, length: int) -> None:
        """The sequence now has ``length`` committed tokens."""
        self.drafter.rollback(self.drafter_state, length)

    def release(self) -> None:
        """Free the drafter's state (idempotent)."""
        if self.state is not None:
            self.drafter.release(self.state)
            self.state = None

    # How far a round drafts, as the drafting source's policy judges (``DraftJudge``).
    def worth_proposing(self, confidences: Sequence[float]) -> bool:
        return self.policy.worth_proposing(confidences)

    def worth_continuing(self, confidences: Sequence[float]) -> bool:
        return self.policy.worth_continuing(confidences)

    def worth_alternative(self, confidences: Sequence[float], confidence: float) -> bool:
        return self.alternatives and self.policy.worth_alternative(confidences, confidence)
