"""How many tokens to draft next round.

The policy keeps, for every draft position i, the chance that it is accepted
given that positions before it were (drafts come in runs: an n-gram copy that
starts right tends to stay right, so one per-token rate would undersell long
drafts). From those rates and the relative cost of drafting and verifying it
picks the k that maximises expected committed tokens per unit of time:

    tokens(k) = 1 + sum_{j<k} prod_{i<=j} p_i    (the 1 is the recovered or bonus token)
    cost(k)   = 1 + (VERIFY_COST_PER_TOKEN + draft_cost_per_token) * k

With equal p_i this is Leviathan et al. (2023), eq. 1. So k grows while drafts
are accepted, shrinks after early rejections, and falls back to plain decoding
(k = 0) when speculation stops paying; it probes again every PROBE_INTERVAL
rounds.

A draft model also says how sure it is of each token it drafts (its largest
probability). Then the round's length is decided as it is drafted: before
drafting another token, the chance that every draft so far is accepted times the
drafter's mean acceptance must beat one more token's cost (verifying and drafting
it) at the rate the round promises so far (``worth_continuing``); after drafting
it, the same with that token's own chance, else it is withheld
(``worth_proposing``). The chances come from the confidences, calibrated online
against verification per tenth of confidence. Whether to draft at all then
follows the committed tokens per cost that recent rounds promised, and k is only
a cap. On the benchmark's chat outputs the shipped draft's
confidence tracks acceptance (drafted at 0.4-0.5: accepted 45%; at 0.9-1.0: 96%);
on grounded ones it runs high (0.6-0.7: 29%), hence the calibration. Replayed on
those chat outputs with a 2-core CPU's costs (verify 0.05, draft 0.075 of a step
per token), the best fixed length (2) gives 1.28x, judging each token only after
drafting it 1.28x (the withheld token's draft step eats the gain), and judging
before as well 1.32x.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_DRAFT_TOKENS = 1
MAX_DRAFT_TOKENS = 8
INITIAL_ALPHA = 0.6  # optimistic start: the first rounds measure the truth
INITIAL_WEIGHT = 2.0  # pseudo-rounds behind INITIAL_ALPHA; they fade like real history
INHERIT_WEIGHT = 0.5  # pseudo-rounds by which a position leans on the one before it
# Weight of history in the acceptance estimates, per round (about 20 rounds of memory). With
# a short memory (0.8) a draft model accepted a third of the time kept reading a few unlucky
# rounds as "speculation does not pay" and sat out the next 16 rounds. Replaying the chat
# prompts' greedy rounds (as `specserve acceptance` does) under this policy, with the measured
# costs of the default model on a 2-core CPU, 0.8 -> 0.95 took the modelled gain of the
# default draft from 1.11x to 1.20x and of lookup + draft from 1.22x to 1.32x, while lookup
# alone moved by under 1% (its runs are long and its rates extreme). Measured (`specserve
# bench`, all chat prompts, float32): the draft then shipped 1.08x -> 1.15x, with lookup
# 1.19x -> 1.24x.
HISTORY_DECAY = 0.95
# Extra verify time per draft token, in target steps. On a 2-core AVX-512 CPU with the default
# model: about 0.055 (float32) and 0.025 (bfloat16) while the runner's products read plain
# weights; with its weights packed for oneDNN, passes of 1 to 8 tokens cost within noise of
# one another (about 0.02 a token, float32 and bfloat16 alike). A GPU at small batch: less.
VERIFY_COST_PER_TOKEN = 0.02
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
COST_DECAY = 0.9


def _initial_tries() -> list[float]:
    return [INITIAL_WEIGHT] + [0.0] * (MAX_DRAFT_TOKENS - 1)


def _initial_hits() -> list[float]:
    return [INITIAL_WEIGHT * INITIAL_ALPHA] + [0.0] * (MAX_DRAFT_TOKENS - 1)


def _bins() -> list[float]:
    return [0.0] * CONFIDENCE_BINS


def _bin_midpoints() -> list[float]:
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
    _step_s: float = 0.0  # measured plain target step time
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
        return chance * cost >= VERIFY_COST_PER_TOKEN * tokens

    def worth_continuing(self, confidences: Sequence[float]) -> bool:
        """Whether to draft another token after ``confidences`` (all proposed), before
        paying for it: as ``worth_proposing``, with the drafter's mean acceptance
        standing in for the unknown token's. Saves a draft step that the chance so
        far already says would be withheld (replayed on the chat outputs: 1.28x ->
        1.32x; drafting first and judging after made 1.28x, as the best fixed length)."""
        run, tokens, cost = self._round_so_far(confidences)
        chance = run * self.mean_acceptance()
        return chance * cost >= (VERIFY_COST_PER_TOKEN + self.draft_cost_per_token) * tokens

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
        return self.alternative_chance(confidence) * cost >= VERIFY_COST_PER_TOKEN * tokens

    def _round_so_far(self, confidences: Sequence[float]) -> tuple[float, float, float]:
        """(chance that every draft so far is accepted, expected committed tokens, cost
        in target steps) of a round whose proposed drafts had ``confidences``."""
        per_token = VERIFY_COST_PER_TOKEN + self.draft_cost_per_token
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
        if verify_s > 0:  # a verify of k drafts costs about (1 + VERIFY_COST_PER_TOKEN * k) steps
            self._step_s = _ema(self._step_s, verify_s / (1 + VERIFY_COST_PER_TOKEN * verified))
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
            self.draft_s_per_token = _ema(self.draft_s_per_token, draft_s / steps)
        if draft_s > 0 and self._step_s > 0 and not first:
            per_token = draft_s / steps / self._step_s
            self.draft_cost_per_token = _ema(self.draft_cost_per_token, per_token)
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
        cost = 1 + VERIFY_COST_PER_TOKEN * drafted + self.draft_cost_per_token * steps
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
        return [self.accept_chance(mid) for mid in _bin_midpoints()]

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
            cost = 1 + (VERIFY_COST_PER_TOKEN + self.draft_cost_per_token) * k
            if tokens / cost > best_rate * (MIN_GAIN if best_k == 0 else 1.0):
                best_k, best_rate = k, tokens / cost
        return best_k


class SpeculationPrior:
    """What earlier requests learned about one drafter, as a head start for new ones.

    Each finished request's per-position acceptance rates are folded in, weighted by
    the rounds it drafted; a new request's policy starts from them (worth
    ``INITIAL_WEIGHT`` rounds, so its own rounds soon dominate) instead of the
    optimistic ``INITIAL_ALPHA``: on text where a drafter rarely helps, new requests
    no longer spend their first rounds finding that out again.
    """

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self._weight = 0.0
        self._rates = [0.0] * MAX_DRAFT_TOKENS
        self._draft_s = 0.0
        self._expected = 0.0  # accepted drafts the policies' rates promised (recent rounds)
        self._confident = False  # the drafter reports confidences (see AdaptiveSpeculation)
        self._calibration = _bin_midpoints()
        self._gain = MIN_GAIN
        self._accepted = 0.0  # ... and what verification accepted in those rounds
        self._alternatives = 1.0  # alternatives' calibration (see AdaptiveSpeculation)

    @property
    def known(self) -> bool:
        return self._weight > 0

    def record(self, expected: float, accepted: int) -> None:
        """One batch-planned round: the accepted drafts its policy's rates promised for
        the tokens it drafted, and how many were accepted."""
        self._expected = CALIBRATION_DECAY * self._expected + expected
        self._accepted = CALIBRATION_DECAY * self._accepted + accepted

    @property
    def calibration(self) -> float:
        """Accepted over promised drafts of recent rounds, in [MIN_CALIBRATION, 1]; 1 until
        the rounds have promised CALIBRATION_EVIDENCE drafts. The batch planner picks the
        streams whose rates look best, so the rates it acts on run high (with the shipped
        draft and lookup on chat, 8 streams: 2.0x and 1.5x what was accepted)."""
        if self._expected < CALIBRATION_EVIDENCE:
            return 1.0
        return min(1.0, max(MIN_CALIBRATION, self._accepted / self._expected))

    def observe(self, policy: AdaptiveSpeculation) -> None:
        rounds = max(policy.drafted_rounds, policy.confident_rounds)
        if rounds == 0:
            return
        w = min(1.0, rounds / 8)  # a short request counts for less
        self._weight = self.decay * self._weight + w
        share = w / self._weight
        rates = policy.position_rates()
        self._rates = [(1 - share) * old + share * new
                       for old, new in zip(self._rates, rates, strict=True)]
        if policy.confident:
            self._confident = True
            self._calibration = [(1 - share) * old + share * new for old, new in
                                 zip(self._calibration, policy.calibration(), strict=True)]
            self._gain = (1 - share) * self._gain + share * policy.realised_gain
        if policy.alternatives:
            self._alternatives = ((1 - share) * self._alternatives
                                  + share * policy.alternative_calibration)
        if policy.draft_s_per_token > 0:
            self._draft_s = _ema(self._draft_s, policy.draft_s_per_token)

    def new_policy(self) -> AdaptiveSpeculation:
        policy = AdaptiveSpeculation()
        if self.known:
            policy._tries = [INITIAL_WEIGHT] * MAX_DRAFT_TOKENS
            policy._hits = [INITIAL_WEIGHT * rate for rate in self._rates]
            policy.draft_s_per_token = self._draft_s
            policy.k = max(policy.best_k(), MIN_DRAFT_TOKENS)  # one token to measure itself
            policy.informed = True
        if self._confident:  # its first round drafts as far as its confidence goes
            policy.confident = True
            policy._bin_base = list(self._calibration)
            policy._gain_tokens = INITIAL_WEIGHT * max(self._gain, MIN_GAIN)
            policy.k = policy.max_tokens
            policy._alt_base = self._alternatives
        return policy


def _best_single(policy: AdaptiveSpeculation, limit: int, cost: StepCost,
                 draft_s: float) -> int:
    """One sequence alone: every k weighed whole (a one-token pass is priced on its own,
    so adding draft tokens one at a time could stop at the jump from one token to two).
    A confident drafter gets its policy's cap: it stops by itself."""
    if policy.confident:
        return policy.next_k(limit)
    plain = 1.0 / cost.predict(1)
    best_k, best_rate = 0, plain * BATCH_MIN_GAIN
    for k, tokens in enumerate(policy.expected_tokens(limit), start=1):
        value = tokens / (cost.predict(1 + k) + draft_s * k)
        if value > best_rate:
            best_k, best_rate = k, value
    if best_k == 0 and limit > 0 and policy.wants_probe():
        best_k = MIN_DRAFT_TOKENS
    return best_k


def _ema(previous: float, value: float) -> float:
    return value if previous <= 0 else COST_DECAY * previous + (1 - COST_DECAY) * value


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


# -- many sequences in one forward pass ---------------------------------------------------

COST_HISTORY_DECAY = 0.97  # weight of older forward passes in the step-cost fit
BATCH_MIN_GAIN = 1.05  # a batch plan must promise this much over plain batched decoding
CALIBRATION_DECAY = 0.98  # weight of older rounds in a drafter's calibration (~50 rounds)
CALIBRATION_EVIDENCE = 4.0  # promised drafts before a calibration is used
MIN_CALIBRATION = 0.25


class StepCost:
    """The target's forward time as ``fixed + per_token * tokens``, fitted online.

    On a CPU, or a GPU at small batch, ``fixed`` is reading the weights and
    ``per_token`` the arithmetic for each token in the pass: verifying a draft
    token is nearly free for one stream and costs nearly a full token's work in
    a large batch. Until passes of different sizes have been seen, ``per_token``
    is assumed to be ``VERIFY_COST_PER_TOKEN`` of a one-token pass.

    A one-token pass is timed on its own: it may run through a different product (a
    CPU without oneDNN takes a faster matrix-vector one), so the line is fitted to
    passes of two or more tokens and ``predict(1)`` is the measured one-token time.
    """

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._seen: set[int] = set()
        self._single = 0.0  # measured time of a one-token pass

    @property
    def known(self) -> bool:
        return self._w > 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if not self._seen:  # a prior line through the first pass, slope from the constant
            fixed = seconds / (1 + VERIFY_COST_PER_TOKEN * (tokens - 1))
            for x in (1, 1 + MAX_DRAFT_TOKENS):
                self._add(x, fixed * (1 + VERIFY_COST_PER_TOKEN * (x - 1)), 1.0)
        self._seen.add(tokens)
        if tokens == 1:
            self._single = _ema(self._single, seconds)
            if len(self._seen) > 1:
                return  # the line has passes of its own size to go by
        self._decay()
        self._add(tokens, seconds, 1.0)

    def line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token)."""
        if not self.known:
            return 0.0, 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        slope = (self._xy / self._w - mean_x * mean_y) / var if var > 1e-9 else 0.0
        # a token never costs more than the weights' pass itself: noisy timings of a tiny
        # model must not make every draft token look dear
        slope = min(max(slope, 0.0), mean_y / (1 + mean_x))
        fixed = max(mean_y - slope * mean_x, 0.0)
        return fixed, slope

    def predict(self, tokens: int) -> float:
        if tokens == 1 and self._single > 0:
            return self._single
        fixed, slope = self.line()
        return fixed + slope * tokens

    def _decay(self) -> None:
        d = COST_HISTORY_DECAY
        self._w, self._x, self._y, self._xx, self._xy = (
            d * self._w, d * self._x, d * self._y, d * self._xx, d * self._xy)

    def _add(self, x: float, y: float, w: float) -> None:
        self._w += w
        self._x += w * x
        self._y += w * y
        self._xx += w * x * x
        self._xy += w * x * y


def plan_batch(
    policies: list[AdaptiveSpeculation | None],
    limits: list[int],
    cost: StepCost,
    draft_seconds: list[float] | None = None,
    calibration: list[float] | None = None,
) -> list[int]:
    """Draft lengths for the sequences of one forward pass, chosen together.

    Each sequence's policy gives the chance that its next draft positions are
    accepted; ``cost`` says what every extra token in the pass costs at this
    batch size. Draft tokens are added one at a time where they are most likely
    to be kept, while the batch's expected committed tokens per second still
    rises: in a small batch every sequence drafts as its own policy would, in a
    large one speculation shrinks and, past the point where plain batched decoding
    wins, stops. ``None`` policies (no drafter) and zero limits get no draft. A
    sequence whose drafts have never been verified drafts as its own policy says
    (its first round measures the drafter) unless earlier requests measured it.
    ``calibration`` (per sequence, default 1) scales the chance that its first draft
    is accepted, and so every later one: how far its drafter's rates have proven
    optimistic in earlier batch-planned rounds (``SpeculationPrior.calibration``).
    One sequence alone is planned from its own rates.
    """
    n = len(policies)
    ks = [0] * n
    if not cost.known:  # no measurement yet: each sequence's own choice
        return [min(p.next_k(limit), limit) if p is not None else 0
                for p, limit in zip(policies, limits, strict=True)]
    fresh = [p is not None and p.drafted_rounds == 0 and not p.informed and limit > 0
             for p, limit in zip(policies, limits, strict=True)]
    per_token = cost.line()[1]
    draft_s = draft_seconds or [0.0] * n
    if n == 1 and policies[0] is not None and not fresh[0]:
        return [_best_single(policies[0], limits[0], cost, draft_s[0])]
    scale = calibration or [1.0] * n
    rates = [[r * scale[i] if j == 0 else r for j, r in enumerate(p.position_rates())]
             if p is not None else [] for i, p in enumerate(policies)]
    run = [1.0] * n  # chance that every draft so far in sequence i is kept
    expected = float(n)  # each sequence commits at least one token
    seconds = cost.predict(n)
    while True:
        best, best_gain = -1, 0.0
        for i, p in enumerate(policies):
            if p is None or ks[i] >= min(limits[i], p.max_tokens, len(rates[i])):
                continue
            gain = run[i] * rates[i][ks[i]]
            extra = per_token + draft_s[i]
            if gain > best_gain and (expected + gain) / (seconds + extra) > expected / seconds:
                best, best_gain = i, gain
        if best < 0:
            break
        ks[best] += 1
        run[best] *= rates[best][ks[best] - 1]
        expected += best_gain
        seconds += per_token + draft_s[best]
    if sum(ks) and expected / seconds < BATCH_MIN_GAIN * n / cost.predict(n):
        ks = [0] * n  # not worth it: plain decoding
    for i, p in enumerate(policies):
        if p is None or limits[i] <= 0:
            continue
        if fresh[i]:
            ks[i] = max(ks[i], min(p.next_k(limits[i]), limits[i]))
        elif ks[i] == 0 and p.best_k() == 0 and p.wants_probe():
            # its own drafts stopped paying (not just the batch's size): probe now and then
            ks[i] = MIN_DRAFT_TOKENS
    return ks
