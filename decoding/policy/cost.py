"""What a target pass costs, fitted online: one weighted least-squares line of seconds
against tokens, read two ways; and what a draft token costs a sequence's round.

``StepCost`` is the engine's: a whole pass against the tokens in it, for the batch plan.
``VerifyCost`` is a sequence's own: its rounds against the draft tokens they verified,
in target steps, for the draft length. Both decay older passes so the line follows the
machine's load and the context's growth. ``RoundCost`` adds drafting to ``VerifyCost``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_DRAFT_TOKENS = 16
# Extra verify time per draft token, in target steps (measured: docs/performance.md)
VERIFY_COST_PER_TOKEN = 0.02
VERIFY_FIT_DECAY = 0.95  # weight of older rounds in a sequence's verify-cost fit
COST_HISTORY_DECAY = 0.97  # weight of older forward passes in the step-cost fit
EMA_DECAY = 0.9  # weight of the running value in ``ema``


def ema(previous: float, value: float) -> float:
    """An exponential moving average that starts at its first value."""
    return value if previous <= 0 else EMA_DECAY * previous + (1 - EMA_DECAY) * value


@dataclass
class LineFit:
    """Weighted sums for a least-squares line ``y = intercept + slope * x``."""

    weight: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def add(self, x: float, y: float, w: float) -> None:
        self.weight += w
        self._x += w * x
        self._y += w * y
        self._xx += w * x * x
        self._xy += w * x * y

    def decay(self, d: float) -> None:
        """Older points count ``d`` times as much as before."""
        self.weight, self._x, self._y, self._xx, self._xy = (
            d * self.weight, d * self._x, d * self._y, d * self._xx, d * self._xy)

    def fit(self) -> tuple[float, float, float]:
        """(mean x, mean y, slope); the slope is 0 while every x is the same. Needs
        weight."""
        mean_x, mean_y = self._x / self.weight, self._y / self.weight
        var = self._xx / self.weight - mean_x * mean_x
        slope = (self._xy / self.weight - mean_x * mean_y) / var if var > 1e-9 else 0.0
        return mean_x, mean_y, slope


@dataclass(frozen=True)
class VerifyCurve:
    """What a pass verifying k draft tokens costs this target on this host, in one-token
    steps: ``steps[k]`` for k = 0 .. len - 1 (``steps[0]`` is 1), measured once
    (``decoding.policy.curve``). A CPU's products read the weights once for a few tokens
    and again for the next few, so the curve is a table, not a line; past its end it grows
    by its last step."""

    steps: tuple[float, ...]
    step_s: float = 0.0  # a one-token pass, in seconds, when it was measured

    def at(self, k: int) -> float:
        if k < len(self.steps):
            return self.steps[k]
        last = len(self.steps) - 1
        slope = self.steps[last] - self.steps[last - 1] if last > 0 else 0.0
        return self.steps[last] + slope * (k - last)

    def ceiling(self, acceptance: float, draft_cost: float, most: int = MAX_DRAFT_TOKENS
                ) -> tuple[int, float]:
        """The best draft length and its speed-up over plain decoding for a drafter whose
        tokens are each accepted with chance ``acceptance`` and cost ``draft_cost`` steps:
        (1 - a^(k+1)) / ((1 - a)(k c + V(k))) (Leviathan et al. 2023, eq. 1, with the
        measured V); (0, 1.0) where no length pays."""
        best_k, best = 0, 1.0
        for k in range(1, most + 1):
            tokens = float(k + 1) if acceptance >= 1 else (
                (1 - acceptance ** (k + 1)) / (1 - acceptance))
            gain = tokens / (k * draft_cost + self.at(k))
            if gain > best:
                best_k, best = k, gain
        return best_k, best


@dataclass
class VerifyCost:
    """What verifying costs, fitted from a sequence's own rounds: seconds of a pass as
    ``step_s * (1 + per_token * verified)``. A target whose products cost little more for
    a few tokens than for one (packed float weights) keeps about VERIFY_COST_PER_TOKEN;
    one whose kernel's time grows with the tokens (the CPU's int4 kernel) measures far
    more, and speculation must then be surer to pay. Starts on the ``prior`` line."""

    prior: float = VERIFY_COST_PER_TOKEN
    curve: VerifyCurve | None = None  # the target's measured curve, where there is one
    _fit: LineFit = field(default_factory=LineFit)

    def steps(self, verified: int) -> float:
        """A pass verifying ``verified`` draft tokens, in one-token steps: the measured
        curve where there is one, else the fitted line."""
        if self.curve is not None:
            return self.curve.at(verified)
        return 1 + self.per_token * verified

    def marginal(self, verified: int) -> float:
        """What the ``verified``-th draft token adds to its pass, in one-token steps."""
        if self.curve is not None:
            return self.curve.at(verified) - self.curve.at(verified - 1)
        return self.per_token

    def observe(self, verified: int, seconds: float) -> None:
        if seconds <= 0:
            return
        if self._fit.weight == 0:  # the prior line through the first round, worth one round
            step = seconds / (1 + self.prior * verified)
            for x in (0, MAX_DRAFT_TOKENS):
                self._fit.add(x, step * (1 + self.prior * x), 0.5)
        self._fit.decay(VERIFY_FIT_DECAY)
        self._fit.add(verified, seconds, 1.0)

    def _line(self) -> tuple[float, float]:
        mean_x, mean_y, slope = self._fit.fit()
        return max(mean_y - slope * mean_x, 1e-9), max(slope, 0.0)

    @property
    def step_s(self) -> float:
        """A pass verifying nothing (0 until a round was seen)."""
        return self._line()[0] if self._fit.weight else 0.0

    @property
    def per_token(self) -> float:
        """One more verified token, in target steps."""
        if not self._fit.weight:
            return self.prior
        step, slope = self._line()
        return min(slope / step, 2.0)


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
        self._fit = LineFit()
        self._seen: set[int] = set()
        self._single = 0.0  # measured time of a one-token pass

    @property
    def known(self) -> bool:
        return self._fit.weight > 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if not self._seen:  # a prior line through the first pass, slope from the constant
            fixed = seconds / (1 + VERIFY_COST_PER_TOKEN * (tokens - 1))
            for x in (1, 1 + MAX_DRAFT_TOKENS):
                self._fit.add(x, fixed * (1 + VERIFY_COST_PER_TOKEN * (x - 1)), 1.0)
        self._seen.add(tokens)
        if tokens == 1:
            self._single = ema(self._single, seconds)
            if len(self._seen) > 1:
                return  # the line has passes of its own size to go by
        self._fit.decay(COST_HISTORY_DECAY)
        self._fit.add(tokens, seconds, 1.0)

    def line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token)."""
        if not self.known:
            return 0.0, 0.0
        mean_x, mean_y, slope = self._fit.fit()
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


@dataclass
class RoundCost:
    """What a draft token costs one sequence's round, in target steps: verifying it
    (``verify``, fitted from the sequence's rounds) and drafting it (measured as rounds go;
    a drafter's first round, which also feeds it the whole prompt, is not a draft step's
    cost and is not measured)."""

    draft_per_token: float = 0.0  # a draft step, in target steps
    verify: VerifyCost = field(default_factory=VerifyCost)
    draft_s_per_token: float = 0.0  # a draft step, in seconds
    _draft_steps_seen: int = 0

    @property
    def per_token(self) -> float:
        """Drafting and verifying one more token, in target steps."""
        return self.verify.per_token + self.draft_per_token

    def steps(self, drafted: int) -> float:
        """A round that drafts and verifies ``drafted`` tokens, in target steps."""
        return self.verify.steps(drafted) + self.draft_per_token * drafted

    def observe(self, verified: int, steps: int, draft_s: float, verify_s: float) -> None:
        """A round that ran ``steps`` draft steps in ``draft_s`` seconds and verified
        ``verified`` tokens in ``verify_s``."""
        self.verify.observe(verified, verify_s)
        if steps == 0:
            return
        first = self._draft_steps_seen == 0
        self._draft_steps_seen += steps
        if draft_s > 0 and not first:
            self.draft_s_per_token = ema(self.draft_s_per_token, draft_s / steps)
        if draft_s > 0 and self.verify.step_s > 0 and not first:
            self.draft_per_token = ema(self.draft_per_token, draft_s / steps / self.verify.step_s)
