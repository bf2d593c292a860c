"""The drafter contract."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from decoding.features import FeatureRows
from decoding.sampling import Randomness
from decoding.types import SamplingParams

StateT = TypeVar("StateT")  # a drafter's per-sequence state


@dataclass(frozen=True)
class DraftProposal:
    tokens: tuple[int, ...]  # [k'] with k' <= k; may be empty
    probs: torch.Tensor | None = None  # [k', vocab] the distribution each token was drawn from;
    # None when the drafter is deterministic (verification treats it as one-hot)
    confidence: tuple[float, ...] = ()  # the drafter's probability of each token it drafted,
    # one more than ``tokens`` when it withheld its last (``DraftContext.judge``); empty
    # from a drafter without a distribution (lookup)
    alternative: int | None = None  # greedy only: the drafter's second choice for the first
    # token, verified beside the draft in the same pass (taken when the target rejects
    # ``tokens[0]`` for it)
    alternative_confidence: float = 0.0  # the drafter's probability of ``alternative``

    @staticmethod
    def empty() -> DraftProposal:
        return DraftProposal(tokens=())


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may look at when proposing."""

    token_ids: Sequence[int]  # every committed token: prompt then output
    sampling: SamplingParams
    generator: Randomness | None  # None when decoding greedily; a SamplingKey: keyed
    judge: DraftJudge | None = None  # None: draft all k
    features: FeatureRows | None = None  # the target's final hidden states, by position
    # (for a drafter that ``reads_features``, where the target gives them)


class DraftJudge(Protocol):
    """Decides, from a drafter's confidence in this round's draft tokens so far, how far
    the round drafts (a drafter with no such confidence drafts all k)."""

    def worth_proposing(self, confidences: Sequence[float]) -> bool:
        """Whether the last token (just drafted) is worth verifying; if not, the drafter
        withholds it and stops."""
        ...

    def worth_continuing(self, confidences: Sequence[float]) -> bool:
        """Whether drafting one more token is worth its cost, before it is drafted (every
        token in ``confidences`` is proposed)."""
        ...

    def worth_alternative(self, confidences: Sequence[float], confidence: float) -> bool:
        """Whether the drafter's second choice for the first token, at ``confidence``, is
        worth verifying beside a draft whose tokens had ``confidences`` (greedy only;
        False where the target cannot verify one)."""
        ...


class Drafter(Protocol[StateT]):
    """Proposes up to k tokens per round; keeps per-sequence state it can roll back.
    ``BaseDrafter`` gives the optional members their plain meaning."""

    name: str
    reads_features: bool  # proposes from the target's hidden states (DraftContext.features)

    def begin(self, prompt_ids: Sequence[int]) -> StateT:
        """Start a sequence; returns the drafter's state for it."""
        ...

    def propose(self, state: StateT, context: DraftContext, k: int) -> DraftProposal: ...

    def propose_many(self, states: Sequence[StateT], contexts: Sequence[DraftContext],
                     ks: Sequence[int]) -> list[DraftProposal]:
        """Proposals for several sequences: together where the drafter can (a batched
        draft model runs each draft step for all of them in one pass)."""
        ...

    def source(self, state: StateT, context: DraftContext) -> str:
        """Which of the drafter's sources drafts the next round ("" for a drafter with
        one). A drafter that combines sources (lookup, a model) names the one it will use
        before the round's length is chosen, so that each source gets a length policy of
        its own: a source whose drafts are often rejected must not shorten the long, free
        runs of another."""
        ...

    def rollback(self, state: StateT, length: int) -> None:
        """The sequence now has ``length`` committed tokens; forget anything beyond."""
        ...

    def release(self, state: StateT) -> None:
        """The sequence is finished; free what its state holds."""
        ...

    def warmup(self) -> None:
        """Prepare kernels before the first request needs them."""
        ...


class BaseDrafter(Generic[StateT]):
    """The optional members of ``Drafter``, in their plain form: one source, proposals
    one sequence after another, nothing to warm up."""

    name: str = "drafter"
    reads_features: bool = False

    def propose(self, state: StateT, context: DraftContext, k: int) -> DraftProposal:
        raise NotImplementedError

    def propose_many(self, states: Sequence[StateT], contexts: Sequence[DraftContext],
                     ks: Sequence[int]) -> list[DraftProposal]:
        return [self.propose(s, c, k) for s, c, k in zip(states, contexts, ks, strict=True)]

    def source(self, state: StateT, context: DraftContext) -> str:
        return ""

    def warmup(self) -> None:
        return None
