"""Draft lengths for a batch: many sequences in one forward pass.

``StepCost`` (decoding.policy.cost) prices the passes; ``plan_batch``
spends draft tokens where they are most likely kept while the batch's committed tokens
per second still rise; ``SpeculationPrior`` carries what finished requests learned of a
drafter to new ones.
"""

from __future__ import annotations

from decoding.policy.acceptance import bin_midpoints
from decoding.policy.cost import (
    MAX_DRAFT_TOKENS,
    VERIFY_COST_PER_TOKEN,
    StepCost,
    VerifyCurve,
    ema,
)
from decoding.policy.speculation import MIN_DRAFT_TOKENS, MIN_GAIN, AdaptiveSpeculation

BATCH_MIN_GAIN = 1.05  # a batch plan must promise this much over plain batched decoding
CALIBRATION_DECAY = 0.98  # weight of older rounds in a drafter's calibration (~50 rounds)
CALIBRATION_EVIDENCE = 4.0  # promised drafts before a calibration is used
MIN_CALIBRATION = 0.25


class SpeculationPrior:
    """What earlier requests learned about one drafter, as a head start for new ones.

    Each finished request's per-position acceptance rates are folded in, weighted by
    the rounds it drafted; a new request's policy starts from them (worth
    ``INITIAL_WEIGHT`` rounds, so its own rounds soon dominate) instead of the
    optimistic ``INITIAL_ALPHA``: on text where a drafter rarely helps, new requests
    no longer spend their first rounds finding that out again.
    """

    def __init__(self, decay: float = 0.9, curve: VerifyCurve | None = None,
                 draft_cost: float = 0.0) -> None:
        self.decay = decay
        self.curve = curve  # the target's measured verify curve, handed to every policy
        self.draft_cost = draft_cost  # a draft step in target steps, measured at start-up
        self._weight = 0.0
        self._rates = [0.0] * MAX_DRAFT_TOKENS
        self._draft_s = 0.0
        self._verify = VERIFY_COST_PER_TOKEN  # a verified token's cost, in target steps
        self._expected = 0.0  # accepted drafts the policies' rates promised (recent rounds)
        self._confident = False  # the drafter reports confidences (see AdaptiveSpeculation)
        self._calibration = bin_midpoints()
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
        streams whose rates look best, so the rates it acts on run high."""
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
        rates = policy.acceptance.rates()
        self._rates = [(1 - share) * old + share * new
                       for old, new in zip(self._rates, rates, strict=True)]
        if policy.confident:
            self._confident = True
            self._calibration = [(1 - share) * old + share * new for old, new in
                                 zip(self._calibration, policy.calibration.curve(), strict=True)]
            self._gain = (1 - share) * self._gain + share * policy.realised_gain
        if policy.alternatives.verified:
            self._alternatives = ((1 - share) * self._alternatives
                                  + share * policy.alternatives.calibration)
        if policy.cost.draft_s_per_token > 0:
            self._draft_s = ema(self._draft_s, policy.cost.draft_s_per_token)
        self._verify = (1 - share) * self._verify + share * policy.cost.verify.per_token

    def new_policy(self) -> AdaptiveSpeculation:
        policy = AdaptiveSpeculation()
        policy.cost.verify.curve = self.curve
        policy.cost.draft_per_token = self.draft_cost  # until its own steps are timed
        if self.known:
            policy.start_from(self._rates, self._draft_s, self._verify, self.curve)
        if self._confident:
            policy.start_confident(self._calibration, self._gain, self._alternatives)
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
    rates = [[r * scale[i] if j == 0 else r for j, r in enumerate(p.acceptance.rates())]
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
