"""One round's draft for one sequence, as the round carries it from drafting to
verification (``SequenceDecoder.propose`` makes it, ``round.verify_and_commit`` takes it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.constrained import ConstrainedDraft
from decoding.drafters.base import DraftProposal
from decoding.policy import AdaptiveSpeculation


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
