"""How many tokens to draft next round.

The policy estimates the per-token acceptance probability alpha from recent
rounds and the relative cost of drafting and verifying, and picks the k that
maximises expected committed tokens per unit of time:

    tokens(k) = (1 - alpha^(k+1)) / (1 - alpha)        (Leviathan et al., eq. 1)
    cost(k)   = 1 + VERIFY_COST_PER_TOKEN * k + draft_cost_per_token * k

So it grows k while drafts are accepted, shrinks it after early rejections,
and falls back to plain decoding (k = 0) when speculation stops paying, then
probes again every PROBE_INTERVAL rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_DRAFT_TOKENS = 1
MAX_DRAFT_TOKENS = 8
INITIAL_ALPHA = 0.6  # optimistic start: the first rounds measure the truth
HISTORY_DECAY = 0.8  # weight of history in the acceptance estimate, per round
# Extra verify time per draft token, in target steps: measured on a 2-core AVX-512 CPU with
# the default model as about 0.055 (float32) and 0.025 (bfloat16); slightly pessimistic here.
VERIFY_COST_PER_TOKEN = 0.06
MIN_GAIN = 1.02  # speculate only when expected to be at least 2% faster than plain
PROBE_INTERVAL = 16  # plain rounds between probes once speculation backed off
COST_DECAY = 0.9


@dataclass
class AdaptiveSpeculation:
    max_tokens: int = MAX_DRAFT_TOKENS
    draft_cost_per_token: float = 0.0  # in target steps; measured as rounds go
    _accepted: float = INITIAL_ALPHA * 4
    _rejected: float = (1 - INITIAL_ALPHA) * 4
    _plain_rounds: int = 0
    _step_s: float = 0.0  # measured plain target step time
    k: int = 4

    @property
    def alpha(self) -> float:
        total = self._accepted + self._rejected
        return self._accepted / total if total > 0 else INITIAL_ALPHA

    def next_k(self, limit: int) -> int:
        """The number of draft tokens for the next round, at most ``limit``."""
        k = min(self.k, limit, self.max_tokens)
        if k > 0:
            return k
        if limit > 0 and self.max_tokens > 0 and self._plain_rounds >= PROBE_INTERVAL:
            self._plain_rounds = 0
            return min(MIN_DRAFT_TOKENS, limit)
        return 0

    def update(
        self, drafted: int, accepted: int, draft_s: float = 0.0, verify_s: float = 0.0
    ) -> None:
        """Record one round's outcome and choose k for the next round."""
        if drafted == 0:
            self._plain_rounds += 1
            if verify_s > 0:
                self._step_s = _ema(self._step_s, verify_s)
            return
        if verify_s > 0:  # a verify of k drafts costs about (1 + VERIFY_COST_PER_TOKEN * k) steps
            self._step_s = _ema(self._step_s, verify_s / (1 + VERIFY_COST_PER_TOKEN * drafted))
        rejected = 1 if accepted < drafted else 0
        self._accepted = HISTORY_DECAY * self._accepted + accepted
        self._rejected = HISTORY_DECAY * self._rejected + rejected
        if draft_s > 0 and self._step_s > 0:
            per_token = draft_s / drafted / self._step_s
            self.draft_cost_per_token = _ema(self.draft_cost_per_token, per_token)
        self.k = self.best_k()

    def best_k(self) -> int:
        alpha = min(self.alpha, 0.999)
        best_k, best_rate = 0, 1.0
        for k in range(MIN_DRAFT_TOKENS, self.max_tokens + 1):
            tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
            cost = 1 + (VERIFY_COST_PER_TOKEN + self.draft_cost_per_token) * k
            if tokens / cost > best_rate * (MIN_GAIN if best_k == 0 else 1.0):
                best_k, best_rate = k, tokens / cost
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

    def update(self, drafted: int, accepted: int, draft_s: float = 0.0,
               verify_s: float = 0.0) -> None:
        return
