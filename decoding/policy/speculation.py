"""How many tokens one sequence drafts next round.

The policy keeps, for every draft position i, the chance that it is accepted given
that positions before it were (drafts come in runs: an n-gram copy that starts right
tends to stay right). From those rates and the relative cost of drafting and verifying
it picks the k that maximises expected committed tokens per unit of time:

    tokens(k) = 1 + sum_{j<k} prod_{i<=j} p_i    (the 1 is the recovered or bonus token)
    cost(k)   = 1 + (verify_cost_per_token + draft_cost_per_token) * k

With equal p_i this is Leviathan et al. (2023), eq. 1. The verify cost per token is
measured from the sequence's own rounds (``VerifyCost``), starting from
VERIFY_COST_PER_TOKEN or what earlier requests measured. k grows while drafts are
accepted, shrinks after early rejections, and falls back to plain decoding (k = 0)
when speculation stops paying; it probes again every PROBE_INTERVAL rounds.

A draft model also says how sure it is of each token (its largest probability): then
the round's length is decided as it is drafted (``worth_continuing`` before a draft
step, ``worth_proposing`` after it), from confidences calibrated online against
verification per tenth of confidence. How these choices measured: docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decoding.policy.cost import MAX_DRAFT_TOKENS, VERIFY_COST_PER_TOKEN, VerifyCost, ema

MIN_DRAFT_TOKENS = 1
INITIAL_ALPHA = 0.6  # optimistic start: the first rounds measure the truth
INITIAL_WEIGHT = 2.0  # pseudo-rounds behind INITIAL_ALPHA; they fade like real history
INHERIT_WEIGHT = 0.5  # pseudo-rounds by which a position leans on the one before it
# Weight of history in the acceptance estimates, per round (about 20 rounds of memory;
# docs/performance.md says how it was chosen)
HISTORY_DECAY = 0.95
MIN_GAIN = 1.02  # speculate only when expected to be at least 2% faster than plain
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
PROBE_INTERVAL = 16  # plain rounds between probes once speculation backed off


def _initial_tries() -> list[float]:
    return [INITIAL_WEIGHT] + [0.0] * (MAX_DRAFT_TOKENS - 1)


def _initial_hits() -> list[float]:
    return [INITIAL_WEIGHT * INITIAL_ALPHA] + [0.0] * (MAX_DRAFT_TOKENS - 1)


def _bins() -> list[float]:
    return [0.0] * CONFIDENCE_BINS


def bin_midpoints() -> list[float]:
    return [(b + 0.5) / CONFIDENCE_BINS for b in range(CONFIDENCE_BINS)]


def confidence_bin(confidence: float) -> int:
    return min(max(int(confidence * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1)


@dataclass
class AdaptiveSpeculation:
    max_tokens: int = MAX_DRAFT_TOKENS
    draft_cost_per_token: float = 0.0  # in target steps; measured as rounds go
    k: int = 4
    _tries: list[float] = field(default_factory=_initial_tries)  # i drafted, all before kept
    _hits: list[float] = field(default_factory=_initial_hits)  # ... and i accepted too
    _plain_rounds: int = 0
    verify: VerifyCost = field(default_factory=VerifyCost)  # measured verify cost
    draft_s_per_token: float = 0.0  # measured drafting time per draft token, seconds
    drafted_rounds: int = 0  # rounds that verified at least one draft token
    informed: bool = False  # started from rates earlier requests measured (a prior)
    confident: bool = False  # the drafter reports its confidence: it cuts its own drafts
    confident_rounds: int = 0  # rounds a confident drafter ran in (drafting or withholding)
    _draft_steps_seen: int = 0
    _bin_tries: list[float] = field(default_factory=_bins)  # drafted at this confidence ...
    _bin_hits: list[float] = field(default_factory=_bins)  # ... and accepted
    _bin_base: list[float] | None = None  # per bin, what earlier requests measured
    # committed tokens and their cost (in target steps) of the rounds a confident drafter
    # ran in, decayed: whether its rounds pay; starts as INITIAL_WEIGHT rounds that did
    _gain_tokens: float = INITIAL_WEIGHT * MIN_GAIN
    _gain_cost: float = INITIAL_WEIGHT
    _alt_promised: float = 0.0  # the drafter's probability of each alternative verified ...
    _alt_taken: float = 0.0  # ... and how many were taken (both decayed)
    _alt_base: float = 1.0  # taken over promised, as earlier requests measured
    alternatives: int = 0  # alternatives verified
    alternatives_taken: int = 0

    @property
    def alpha(self) -> float:
        """The estimated acceptance rate of the first draft position."""
        return self.position_rates()[0]

    def position_rates(self) -> list[float]:
        """p_i: the chance position i is accepted when every earlier one was."""
        rates = [self._hits[0] / self._tries[0]]
        for tries, hits in zip(self._tries[1:], self._hits[1:], strict=True):
            # a rarely tried position is assumed like the one before it
            rates.append((hits + INHERIT_WEIGHT * rates[-1]) / (tries + INHERIT_WEIGHT))
        return rates

    def next_k(self, limit: int) -> int:
        """The number of draft tokens for the next round, at most ``limit`` (for a
        confident drafter, the most it may draft: it stops sooner by itself)."""
        k = min(self.k, limit, self.max_tokens)
        if k > 0:
            return k
        if limit > 0 and self.max_tokens > 0 and self.wants_probe():
            return min(self.max_tokens if self.confident else MIN_DRAFT_TOKENS, limit)
        return 0

    def accept_chance(self, confidence: float) -> float:
        """The chance that a draft token the drafter gave ``confidence`` is accepted
        (when every draft before it was): the acceptance measured at that confidence,
        leaning on what earlier requests measured there, or on the confidence itself,
        while there is little evidence."""
        b = confidence_bin(confidence)
        base = confidence if self._bin_base is None else self._bin_base[b]
        hits, tries = self._bin_hits[b], self._bin_tries[b]
        return (hits + CONFIDENCE_PRIOR * base) / (tries + CONFIDENCE_PRIOR)

    def worth_proposing(self, confidences: Sequence[float]) -> bool:
        """Whether the last of this round's draft tokens so far (``confidences``: the
        drafter's, in order) should be verified: the chance that it is accepted with
        all before it must beat what verifying it costs (drafting it is paid already)
        at the rate the round's earlier tokens promise; or its confidence is one that
        verification has not measured lately (EXPLORE_EVIDENCE)."""
        if self._bin_tries[confidence_bin(confidences[-1])] < EXPLORE_EVIDENCE:
            return True
        run, tokens, cost = self._round_so_far(confidences[:-1])
        chance = run * self.accept_chance(confidences[-1])
        return chance * cost >= self.verify.per_token * tokens

    def worth_continuing(self, confidences: Sequence[float]) -> bool:
        """Whether to draft another token after ``confidences`` (all proposed), before
        paying for it: as ``worth_proposing``, with the drafter's mean acceptance
        standing in for the unknown token's. Saves a draft step that the chance so
        far already says would be withheld."""
        run, tokens, cost = self._round_so_far(confidences)
        chance = run * self.mean_acceptance()
        return chance * cost >= (self.verify.per_token + self.draft_cost_per_token) * tokens

    @property
    def alternative_calibration(self) -> float:
        """Alternatives taken over the drafter's probabilities for them, lately."""
        prior = ALTERNATIVE_PRIOR
        return (self._alt_taken + prior * self._alt_base) / (self._alt_promised + prior)

    def alternative_chance(self, confidence: float) -> float:
        """The chance that the target takes an alternative the drafter gave ``confidence``."""
        return min(1.0, confidence * self.alternative_calibration)

    def worth_alternative(self, confidences: Sequence[float], confidence: float) -> bool:
        """Whether to verify the drafter's second choice for the first token beside a draft
        whose tokens had ``confidences``: it adds a token when the target takes it, and one
        token to the verify pass, so it must beat that token's cost at the rate the round
        promises (as ``worth_proposing``; its drafting cost is already paid)."""
        _, tokens, cost = self._round_so_far(confidences)
        return self.alternative_chance(confidence) * cost >= self.verify.per_token * tokens

    def _round_so_far(self, confidences: Sequence[float]) -> tuple[float, float, float]:
        """(chance that every draft so far is accepted, expected committed tokens, cost
        in target steps) of a round whose proposed drafts had ``confidences``."""
        per_token = self.verify.per_token + self.draft_cost_per_token
        run = tokens = cost = 1.0
        for confidence in confidences:
            run *= self.accept_chance(confidence)
            tokens += run
            cost += per_token
        return run, tokens, cost

    def mean_acceptance(self) -> float:
        """The share of the drafter's verified tokens that were accepted (INITIAL_ALPHA
        before any)."""
        tries = sum(self._bin_tries) + INITIAL_WEIGHT
        return (sum(self._bin_hits) + INITIAL_WEIGHT * INITIAL_ALPHA) / tries

    @property
    def realised_gain(self) -> float:
        """Committed tokens per target step that recent rounds a confident drafter ran in
        promised (``_calibrate``)."""
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
        verified = drafted + (alternative is not None)
        self.verify.observe(verified, verify_s)
        if alternative is not None:
            self._alt_promised = HISTORY_DECAY * self._alt_promised + alternative
            self._alt_taken = HISTORY_DECAY * self._alt_taken + alternative_taken
            self.alternatives += 1
            self.alternatives_taken += alternative_taken
        steps = max(drafted, len(confidences))  # draft steps run
        if steps == 0:
            self._plain_rounds += 1
            return
        if drafted > 0:  # (else a confident drafter ran, then withheld its token)
            self.drafted_rounds += 1
            for i in range(min(accepted + 1, drafted, MAX_DRAFT_TOKENS)):
                self._tries[i] = HISTORY_DECAY * self._tries[i] + 1
                self._hits[i] = HISTORY_DECAY * self._hits[i] + (1 if i < accepted else 0)
        # A drafter's first round also feeds it the whole prompt: not a draft step's cost.
        first = self._draft_steps_seen == 0
        self._draft_steps_seen += steps
        if draft_s > 0 and not first:
            self.draft_s_per_token = ema(self.draft_s_per_token, draft_s / steps)
        if draft_s > 0 and self.verify.step_s > 0 and not first:
            per_token = draft_s / steps / self.verify.step_s
            self.draft_cost_per_token = ema(self.draft_cost_per_token, per_token)
        if confidences:
            self._calibrate(drafted, accepted, confidences, steps)
            self.k = self.max_tokens if self.realised_gain >= 1.0 else 0
        else:
            self.k = self.best_k()

    def _calibrate(self, drafted: int, accepted: int, confidences: Sequence[float],
                   steps: int) -> None:
        """Learn how often tokens are accepted at each confidence, and what the round
        was worth. Its worth is the committed tokens its drafts promised (calibrated),
        not those it made: as unbiased, and far steadier over a few rounds."""
        self.confident = True
        self.confident_rounds += 1
        _, tokens, _ = self._round_so_far(confidences[:drafted])
        cost = 1 + self.verify.per_token * drafted + self.draft_cost_per_token * steps
        self._gain_tokens = HISTORY_DECAY * self._gain_tokens + tokens
        self._gain_cost = HISTORY_DECAY * self._gain_cost + cost
        self._bin_tries = [HISTORY_DECAY * t for t in self._bin_tries]
        self._bin_hits = [HISTORY_DECAY * h for h in self._bin_hits]
        for i in range(min(accepted + 1, drafted, len(confidences))):
            b = confidence_bin(confidences[i])
            self._bin_tries[b] += 1
            self._bin_hits[b] += 1 if i < accepted else 0

    def calibration(self) -> list[float]:
        """The acceptance measured in each confidence bin (its midpoint where unmeasured)."""
        return [self.accept_chance(mid) for mid in bin_midpoints()]

    def expected_tokens(self, limit: int) -> list[float]:
        """Expected committed tokens of a round drafting k = 1 .. ``limit`` tokens."""
        tokens, run, out = 1.0, 1.0, []
        for rate in self.position_rates()[: min(limit, self.max_tokens)]:
            run *= rate
            tokens += run
            out.append(tokens)
        return out

    def best_k(self) -> int:
        best_k, best_rate = 0, 1.0
        for k, tokens in enumerate(self.expected_tokens(self.max_tokens), start=1):
            cost = 1 + (self.verify.per_token + self.draft_cost_per_token) * k
            if tokens / cost > best_rate * (MIN_GAIN if best_k == 0 else 1.0):
                best_k, best_rate = k, tokens / cost
        return best_k

    def start_from(self, rates: Sequence[float], draft_s_per_token: float,
                   verify_per_token: float = VERIFY_COST_PER_TOKEN) -> None:
        """Start from the per-position acceptance rates earlier requests measured (worth
        INITIAL_WEIGHT rounds, so this request's own rounds soon dominate)."""
        self._tries = [INITIAL_WEIGHT] * MAX_DRAFT_TOKENS
        self._hits = [INITIAL_WEIGHT * rate for rate in rates]
        self.draft_s_per_token = draft_s_per_token
        self.verify = VerifyCost(prior=verify_per_token)
        self.k = max(self.best_k(), MIN_DRAFT_TOKENS)  # one token to measure itself
        self.informed = True

    def start_confident(self, calibration: Sequence[float], gain: float,
                        alternatives: float) -> None:
        """Start as a drafter that reports confidences, from what earlier requests
        measured of them: its first round drafts as far as its confidence goes."""
        self.confident = True
        self._bin_base = list(calibration)
        self._gain_tokens = INITIAL_WEIGHT * max(gain, MIN_GAIN)
        self.k = self.max_tokens
        self._alt_base = alternatives


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
