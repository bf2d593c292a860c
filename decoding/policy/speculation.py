"""How many tokens one sequence drafts next round.

From what verification has shown of the drafts (``decoding.policy.acceptance``: the chance
p_i that draft position i is accepted given that the positions before it were) and what a
round costs (``decoding.policy.cost.RoundCost``: verifying and drafting a token, in target
steps), the policy picks the k that maximises expected committed tokens per unit of time:

    tokens(k) = 1 + sum_{j<k} prod_{i<=j} p_i    (the 1 is the recovered or bonus token)
    cost(k)   = V(k) + draft_cost_per_token * k

With equal p_i this is Leviathan et al. (2023), eq. 1. V(k), a pass verifying k draft
tokens in one-token steps, is the target's measured curve where the engine has one
(``decoding.policy.curve``: products read the weights once per few tokens, so V is a
table with steps, not a line); else the line 1 + verify_cost_per_token * k, fitted from
the sequence's own rounds, starting from VERIFY_COST_PER_TOKEN or what earlier requests
measured. k grows while drafts are accepted, shrinks after early
rejections, and falls back to plain decoding (k = 0) when speculation stops paying; it
probes again every PROBE_INTERVAL rounds.

A draft model also says how sure it is of each token (its largest probability): then
the round's length is decided as it is drafted (``worth_continuing`` before a draft
step, ``worth_proposing`` after it), from confidences calibrated online against
verification per tenth of confidence. How these choices measured: docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decoding.policy.acceptance import (
    HISTORY_DECAY,
    INITIAL_WEIGHT,
    AlternativeCalibration,
    ConfidenceCalibration,
    PositionAcceptance,
)
from decoding.policy.cost import (
    MAX_DRAFT_TOKENS,
    VERIFY_COST_PER_TOKEN,
    RoundCost,
    VerifyCost,
    VerifyCurve,
)

MIN_DRAFT_TOKENS = 1
MIN_GAIN = 1.02  # speculate only when expected to be at least 2% faster than plain
PROBE_INTERVAL = 16  # plain rounds between probes once speculation backed off


@dataclass
class AdaptiveSpeculation:
    max_tokens: int = MAX_DRAFT_TOKENS
    cost: RoundCost = field(default_factory=RoundCost)  # a draft token's, measured
    k: int = 4
    acceptance: PositionAcceptance = field(default_factory=PositionAcceptance)
    calibration: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)
    alternatives: AlternativeCalibration = field(default_factory=AlternativeCalibration)
    drafted_rounds: int = 0  # rounds that verified at least one draft token
    informed: bool = False  # started from rates earlier requests measured (a prior)
    confident: bool = False  # the drafter reports its confidence: it cuts its own drafts
    confident_rounds: int = 0  # rounds a confident drafter ran in (drafting or withholding)
    _plain_rounds: int = 0
    # committed tokens and their cost (in target steps) of the rounds a confident drafter
    # ran in, decayed: whether its rounds pay; starts as INITIAL_WEIGHT rounds that did
    _gain_tokens: float = INITIAL_WEIGHT * MIN_GAIN
    _gain_cost: float = INITIAL_WEIGHT

    @property
    def alpha(self) -> float:
        """The estimated acceptance rate of the first draft position."""
        return self.acceptance.rates()[0]

    def next_k(self, limit: int) -> int:
        """The number of draft tokens for the next round, at most ``limit`` (for a
        confident drafter, the most it may draft: it stops sooner by itself)."""
        k = min(self.k, limit, self.max_tokens)
        if k > 0:
            return k
        if limit > 0 and self.max_tokens > 0 and self.wants_probe():
            return min(self.max_tokens if self.confident else MIN_DRAFT_TOKENS, limit)
        return 0

    def worth_proposing(self, confidences: Sequence[float]) -> bool:
        """Whether the last of this round's draft tokens so far (``confidences``: the
        drafter's, in order) should be verified: the chance that it is accepted with
        all before it must beat what verifying it costs (drafting it is paid already)
        at the rate the round's earlier tokens promise; or its confidence is one that
        verification has not measured lately (EXPLORE_EVIDENCE)."""
        if not self.calibration.measured(confidences[-1]):
            return True
        run, tokens, cost = self._round_so_far(confidences[:-1])
        chance = run * self.calibration.accept_chance(confidences[-1])
        return chance * cost >= self.cost.verify.marginal(len(confidences)) * tokens

    def worth_continuing(self, confidences: Sequence[float]) -> bool:
        """Whether to draft another token after ``confidences`` (all proposed), before
        paying for it: as ``worth_proposing``, with the drafter's mean acceptance
        standing in for the unknown token's. Saves a draft step that the chance so
        far already says would be withheld."""
        run, tokens, cost = self._round_so_far(confidences)
        chance = run * self.calibration.mean_acceptance()
        more = self.cost.verify.marginal(len(confidences) + 1) + self.cost.draft_per_token
        return chance * cost >= more * tokens

    def worth_alternative(self, confidences: Sequence[float], confidence: float) -> bool:
        """Whether to verify the drafter's second choice for the first token beside a draft
        whose tokens had ``confidences``: it adds a token when the target takes it, and one
        token to the verify pass, so it must beat that token's cost at the rate the round
        promises (as ``worth_proposing``; its drafting cost is already paid)."""
        _, tokens, cost = self._round_so_far(confidences)
        more = self.cost.verify.marginal(len(confidences) + 1)
        return self.alternatives.chance(confidence) * cost >= more * tokens

    def _round_so_far(self, confidences: Sequence[float]) -> tuple[float, float, float]:
        """(chance that every draft so far is accepted, expected committed tokens, cost
        in target steps) of a round whose proposed drafts had ``confidences``."""
        run = tokens = 1.0
        for confidence in confidences:
            run *= self.calibration.accept_chance(confidence)
            tokens += run
        return run, tokens, self.cost.steps(len(confidences))

    @property
    def realised_gain(self) -> float:
        """Committed tokens per target step that recent rounds a confident drafter ran in
        promised (``_count_gain``)."""
        return self._gain_tokens / self._gain_cost

    def wants_probe(self) -> bool:
        """After PROBE_INTERVAL rounds without drafting: try one token (and start
        counting again)."""
        if self._plain_rounds >= PROBE_INTERVAL:
            self._plain_rounds = 0
            return True
        return False

    def update(
        self, drafted: int, accepted: int, draft_s: float = 0.0, verify_s: float = 0.0,
        confidences: Sequence[float] = (), alternative: float | None = None,
        alternative_taken: bool = False,
    ) -> None:
        """Record one round's outcome and choose k for the next round. ``confidences``:
        the drafter's confidence in each token it drafted this round, one more than
        ``drafted`` when it withheld its last (empty: it reports none). ``alternative``:
        the drafter's probability of the alternative verified beside the draft (None:
        there was none); ``accepted`` counts the draft's tokens, not the alternative."""
        steps = max(drafted, len(confidences))  # draft steps run
        self.cost.observe(drafted + (alternative is not None), steps, draft_s, verify_s)
        if alternative is not None:
            self.alternatives.record(alternative, alternative_taken)
        if steps == 0:
            self._plain_rounds += 1
            return
        if drafted > 0:  # (else a confident drafter ran, then withheld its token)
            self.drafted_rounds += 1
            self.acceptance.record(drafted, accepted)
        if confidences:
            self.confident = True
            self.confident_rounds += 1
            self._count_gain(drafted, confidences, steps)
            self.calibration.record(drafted, accepted, confidences)
            self.k = self.max_tokens if self.realised_gain >= 1.0 else 0
        else:
            self.k = self.best_k()

    def _count_gain(self, drafted: int, confidences: Sequence[float], steps: int) -> None:
        """What a confident drafter's round was worth: the committed tokens its drafts
        promised (calibrated), not those it made (as unbiased, and far steadier over a
        few rounds), against its cost."""
        _, tokens, _ = self._round_so_far(confidences[:drafted])
        cost = self.cost.verify.steps(drafted) + self.cost.draft_per_token * steps
        self._gain_tokens = HISTORY_DECAY * self._gain_tokens + tokens
        self._gain_cost = HISTORY_DECAY * self._gain_cost + cost

    def expected_tokens(self, limit: int) -> list[float]:
        """Expected committed tokens of a round drafting k = 1 .. ``limit`` tokens."""
        tokens, run, out = 1.0, 1.0, []
        for rate in self.acceptance.rates()[: min(limit, self.max_tokens)]:
            run *= rate
            tokens += run
            out.append(tokens)
        return out

    def best_k(self) -> int:
        best_k, best_rate = 0, 1.0
        for k, tokens in enumerate(self.expected_tokens(self.max_tokens), start=1):
            cost = self.cost.steps(k)
            if tokens / cost > best_rate * (MIN_GAIN if best_k == 0 else 1.0):
                best_k, best_rate = k, tokens / cost
        return best_k

    def start_from(self, rates: Sequence[float], draft_s_per_token: float,
                   verify_per_token: float = VERIFY_COST_PER_TOKEN,
                   curve: VerifyCurve | None = None) -> None:
        """Start from the per-position acceptance rates earlier requests measured (worth
        INITIAL_WEIGHT rounds, so this request's own rounds soon dominate)."""
        self.acceptance = PositionAcceptance.starting_at(rates)
        self.cost.draft_s_per_token = draft_s_per_token
        self.cost.verify = VerifyCost(prior=verify_per_token, curve=curve)
        self.k = max(self.best_k(), MIN_DRAFT_TOKENS)  # one token to measure itself
        self.informed = True

    def start_confident(self, calibration: Sequence[float], gain: float,
                        alternatives: float) -> None:
        """Start as a drafter that reports confidences, from what earlier requests
        measured of them: its first round drafts as far as its confidence goes."""
        self.confident = True
        self.calibration.base = list(calibration)
        self._gain_tokens = INITIAL_WEIGHT * max(gain, MIN_GAIN)
        self.k = self.max_tokens
        self.alternatives.base = alternatives


class FixedSpeculation(AdaptiveSpeculation):
    """Always draft k tokens: for tests and for measuring a drafter's raw cost
    (the adaptive policy backs off from a poor or expensive draft)."""

    def __init__(self, k: int) -> None:
        super().__init__(max_tokens=k, k=k)

    def next_k(self, limit: int) -> int:
        return min(self.k, limit)

    def worth_proposing(self, confidences: Sequence[float]) -> bool:
        return True

    def worth_continuing(self, confidences: Sequence[float]) -> bool:
        return True

    def worth_alternative(self, confidences: Sequence[float], confidence: float) -> bool:
        return False  # exactly k tokens a round, a chain

    def update(self, drafted: int, accepted: int, draft_s: float = 0.0,
               verify_s: float = 0.0, confidences: Sequence[float] = (),
               alternative: float | None = None, alternative_taken: bool = False) -> None:
        return
