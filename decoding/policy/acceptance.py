"""What verification has shown of one sequence's drafts, by draft source: the chance that
each draft position is accepted (``PositionAcceptance``), how often a token is accepted at
the confidence its drafter gave it (``ConfidenceCalibration``), and how often the target
takes the drafter's second choice for a round's first token (``AlternativeCalibration``).
Each forgets older rounds at HISTORY_DECAY, so it follows the text as it changes; the
draft-length policy (``decoding.policy.speculation``) decides from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decoding.policy.cost import MAX_DRAFT_TOKENS

INITIAL_ALPHA = 0.6  # optimistic start: the first rounds measure the truth
INITIAL_WEIGHT = 2.0  # pseudo-rounds behind INITIAL_ALPHA; they fade like real history
INHERIT_WEIGHT = 0.5  # pseudo-rounds by which a position leans on the one before it
# Weight of history in the acceptance estimates, per round (about 20 rounds of memory;
# docs/performance.md says how it was chosen)
HISTORY_DECAY = 0.95
CONFIDENCE_BINS = 10  # calibration of a drafter's confidence: bins of width 0.1
CONFIDENCE_PRIOR = 2.0  # pseudo-tries per bin at the drafter's own word, before evidence
# A token whose confidence bin holds less recent evidence than this (in verified tokens) is
# proposed whatever its chance, to measure it: a drafter that undersells itself would
# otherwise never be verified, so never corrected. One verified token in a bin keeps it
# measured for about 14 rounds (HISTORY_DECAY).
EXPLORE_EVIDENCE = 0.5
# An alternative (the drafter's second choice for the first token, verified beside the draft)
# is taken at about the drafter's probability for it, corrected by how often alternatives
# were taken lately; the correction starts as this much promised probability, taken at the
# rate earlier requests measured (at first, in full).
ALTERNATIVE_PRIOR = 1.0


def bin_midpoints() -> list[float]:
    return [(b + 0.5) / CONFIDENCE_BINS for b in range(CONFIDENCE_BINS)]


def confidence_bin(confidence: float) -> int:
    return min(max(int(confidence * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1)


def _initial_tries() -> list[float]:
    return [INITIAL_WEIGHT] + [0.0] * (MAX_DRAFT_TOKENS - 1)


def _initial_hits() -> list[float]:
    return [INITIAL_WEIGHT * INITIAL_ALPHA] + [0.0] * (MAX_DRAFT_TOKENS - 1)


def _bins() -> list[float]:
    return [0.0] * CONFIDENCE_BINS


@dataclass
class PositionAcceptance:
    """For every draft position i, the chance that it is accepted given that the
    positions before it were (drafts come in runs: an n-gram copy that starts right
    tends to stay right). Starts at INITIAL_ALPHA for the first position."""

    tries: list[float] = field(default_factory=_initial_tries)  # i drafted, all before kept
    hits: list[float] = field(default_factory=_initial_hits)  # ... and i accepted too

    @classmethod
    def starting_at(cls, rates: Sequence[float]) -> PositionAcceptance:
        """Rates earlier requests measured, worth INITIAL_WEIGHT rounds at every position
        (positions past the measured ones like the last measured)."""
        rates = [*rates[:MAX_DRAFT_TOKENS]]
        rates += [rates[-1] if rates else INITIAL_ALPHA] * (MAX_DRAFT_TOKENS - len(rates))
        return cls([INITIAL_WEIGHT] * MAX_DRAFT_TOKENS, [INITIAL_WEIGHT * r for r in rates])

    def rates(self) -> list[float]:
        """p_i: the chance position i is accepted when every earlier one was."""
        rates = [self.hits[0] / self.tries[0]]
        for tries, hits in zip(self.tries[1:], self.hits[1:], strict=True):
            # a rarely tried position is assumed like the one before it
            rates.append((hits + INHERIT_WEIGHT * rates[-1]) / (tries + INHERIT_WEIGHT))
        return rates

    def record(self, drafted: int, accepted: int) -> None:
        """A round that verified ``drafted`` tokens and accepted the first ``accepted``:
        the positions up to the first rejection were tried."""
        for i in range(min(accepted + 1, drafted, MAX_DRAFT_TOKENS)):
            self.tries[i] = HISTORY_DECAY * self.tries[i] + 1
            self.hits[i] = HISTORY_DECAY * self.hits[i] + (1 if i < accepted else 0)


@dataclass
class ConfidenceCalibration:
    """How often a drafter's tokens are accepted at the confidence it gave them (its
    largest probability), per tenth of confidence, measured against verification. A bin
    with little evidence leans on what earlier requests measured there (``base``), or on
    the confidence itself."""

    tries: list[float] = field(default_factory=_bins)  # verified at this confidence ...
    hits: list[float] = field(default_factory=_bins)  # ... and accepted
    base: list[float] | None = None  # per bin, what earlier requests measured

    def accept_chance(self, confidence: float) -> float:
        """The chance that a draft token the drafter gave ``confidence`` is accepted
        (when every draft before it was)."""
        b = confidence_bin(confidence)
        base = confidence if self.base is None else self.base[b]
        return (self.hits[b] + CONFIDENCE_PRIOR * base) / (self.tries[b] + CONFIDENCE_PRIOR)

    def measured(self, confidence: float) -> bool:
        """Whether verification measured tokens at ``confidence`` lately
        (EXPLORE_EVIDENCE)."""
        return self.tries[confidence_bin(confidence)] >= EXPLORE_EVIDENCE

    def mean_acceptance(self) -> float:
        """The share of the drafter's verified tokens that were accepted (INITIAL_ALPHA
        before any)."""
        tries = sum(self.tries) + INITIAL_WEIGHT
        return (sum(self.hits) + INITIAL_WEIGHT * INITIAL_ALPHA) / tries

    def record(self, drafted: int, accepted: int, confidences: Sequence[float]) -> None:
        """A round whose ``drafted`` tokens had ``confidences`` and whose first
        ``accepted`` were accepted (older rounds fade)."""
        self.tries = [HISTORY_DECAY * t for t in self.tries]
        self.hits = [HISTORY_DECAY * h for h in self.hits]
        for i in range(min(accepted + 1, drafted, len(confidences))):
            b = confidence_bin(confidences[i])
            self.tries[b] += 1
            self.hits[b] += 1 if i < accepted else 0

    def curve(self) -> list[float]:
        """The acceptance measured in each confidence bin (its midpoint where unmeasured)."""
        return [self.accept_chance(mid) for mid in bin_midpoints()]


@dataclass
class AlternativeCalibration:
    """How often the target takes an alternative (the drafter's second choice for a
    round's first token, verified beside the draft) against the drafter's probability
    for it."""

    verified: int = 0  # alternatives verified
    taken: int = 0  # ... and taken
    base: float = 1.0  # taken over promised, as earlier requests measured
    _promised: float = 0.0  # the drafter's probability of each alternative verified ...
    _taken: float = 0.0  # ... and how many were taken (both decayed)

    def record(self, confidence: float, taken: bool) -> None:
        """An alternative the drafter gave ``confidence`` was verified."""
        self._promised = HISTORY_DECAY * self._promised + confidence
        self._taken = HISTORY_DECAY * self._taken + taken
        self.verified += 1
        self.taken += taken

    @property
    def calibration(self) -> float:
        """Alternatives taken over the drafter's probabilities for them, lately."""
        prior = ALTERNATIVE_PRIOR
        return (self._taken + prior * self.base) / (self._promised + prior)

    def chance(self, confidence: float) -> float:
        """The chance that the target takes an alternative the drafter gave ``confidence``."""
        return min(1.0, confidence * self.calibration)
