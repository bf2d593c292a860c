"""Measuring a target's verify curve: what a pass verifying k draft tokens costs, in
one-token steps, on this host (``decoding.policy.cost.VerifyCurve``).

A round of speculation gives (1 - a^(k+1)) / ((1 - a)(k c + V(k))) times plain decoding
(Leviathan et al. 2023, with a measured V as in Sequoia): whether a drafter can pay on a
target depends on V as much as on its acceptance a and its cost c. V is a property of
the target and the host, not of the text, so it is measured once, before the server takes
requests: passes of 1 .. k + 1 tokens after a short context, each timed ``repeats``
times (the median), divided by the one-token pass. A curve is made monotone (a longer
pass never costs less than a shorter one): timing noise must not make a longer draft look
cheaper.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TypedDict

from decoding.policy.cost import MAX_DRAFT_TOKENS, VerifyCurve
from decoding.target import StateT, Target
from runtime.runner.passes import BatchItem

CONTEXT = 256  # tokens of context the timed passes follow (a short chat's)
REPEATS = 3


class Ceiling(TypedDict):
    k: int  # the best draft length
    speedup: float  # the speed-up over plain decoding it promises


class SpeculationProfile(TypedDict):
    """The target's measured curve and each drafter's ceiling, as ``/v1/models`` shows."""

    step_ms: float
    verify_steps: list[float]
    draft_cost: dict[str, float]  # by drafter: a draft step in target steps
    ceiling: dict[str, dict[str, Ceiling]]  # by drafter, then acceptance ("0.80")


def measure(target: Target[StateT], most: int = MAX_DRAFT_TOKENS, repeats: int = REPEATS,
            clock: Callable[[], float] = time.perf_counter) -> VerifyCurve:
    """The target's verify curve for 0 .. ``most`` draft tokens."""
    vocab = max(target.vocab_size, 2)
    context = [(7 + 13 * i) % vocab for i in range(CONTEXT)]
    state = target.new_state()
    try:
        target.forward_batch([BatchItem(state, context, 1)])
        seconds = []
        for k in range(most + 1):
            tokens = [(11 + 17 * (k + i)) % vocab for i in range(k + 1)]
            times = []
            for _ in range(repeats):
                target.rollback(state, CONTEXT)
                start = clock()
                target.forward_batch([BatchItem(state, tokens, k + 1)])
                times.append(clock() - start)
            seconds.append(statistics.median(times))
    finally:
        target.release(state)
    return from_seconds(seconds)


def from_seconds(seconds: Sequence[float]) -> VerifyCurve:
    """A curve from passes of 1, 2, ... tokens timed in seconds: each over the first,
    never below the one before."""
    if not seconds or seconds[0] <= 0:
        raise ValueError("a verify curve needs a one-token pass of positive time")
    steps, highest = [], 1.0
    for s in seconds:
        highest = max(highest, s / seconds[0])
        steps.append(round(highest, 4))
    return VerifyCurve(tuple(steps), seconds[0])


def draft_cost(draft: Target[StateT], curve: VerifyCurve, repeats: int = REPEATS) -> float:
    """A draft model's one-token step in the target's steps (``c``), both measured here."""
    if curve.step_s <= 0:
        raise ValueError("the target's curve has no measured step")
    return measure(draft, most=0, repeats=repeats).step_s / curve.step_s


def describe(curve: VerifyCurve, draft_costs: dict[str, float],
             acceptances: Sequence[float] = (0.5, 0.7, 0.8, 0.9)) -> SpeculationProfile:
    """The curve and, per drafter (its cost ``c`` in steps) and acceptance, the best
    draft length and the speed-up it promises: what ``/v1/models`` shows."""
    return {
        "step_ms": round(curve.step_s * 1000, 3),
        "verify_steps": list(curve.steps),
        "draft_cost": {name: round(cost, 4) for name, cost in draft_costs.items()},
        "ceiling": {
            name: {f"{a:.2f}": _ceiling(*curve.ceiling(a, cost)) for a in acceptances}
            for name, cost in draft_costs.items()},
    }


def _ceiling(k: int, speedup: float) -> Ceiling:
    return {"k": k, "speedup": round(speedup, 3)}
