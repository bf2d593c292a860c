"""Draft lengths chosen for a batch: the step-cost fit, the batch planner, calibration."""

from __future__ import annotations

import pytest

from decoding.policy import MIN_CALIBRATION, SpeculationPrior, StepCost, plan_batch
from tests.batching import (
    _cost,
    _policy,
)


def test_step_cost_recovers_a_line() -> None:
    cost = StepCost()
    for tokens in (1, 4, 9, 16, 40, 80, 2, 30) * 4:  # the prior line fades as passes come
        cost.observe(tokens, 0.05 + 0.004 * tokens)
    fixed, per_token = cost.line()
    assert fixed == pytest.approx(0.05, rel=0.05)
    assert per_token == pytest.approx(0.004, rel=0.05)


def test_speculation_shrinks_as_the_batch_grows() -> None:
    cost = _cost(0.060, 0.004)  # a draft token costs 1/15 of a step: a CPU-like target
    good = [_policy(0.9)]
    assert sum(plan_batch(good, [100], cost)) >= 4  # one stream: draft long
    totals = [sum(plan_batch([_policy(0.5) for _ in range(n)], [100] * n, cost)) / n
              for n in (1, 4, 16, 64)]
    assert totals[0] > totals[-1]
    assert totals == sorted(totals, reverse=True)
    assert plan_batch([_policy(0.5) for _ in range(64)], [100] * 64, cost) == [0] * 64


def test_a_drafter_that_proved_optimistic_drafts_less_in_a_batch() -> None:
    """The same rates, scaled by how far they have proven optimistic: fewer drafts, and
    none once the batch is better off decoding plainly; one stream alone keeps its own
    rates."""
    cost = _cost(0.060, 0.004)
    policies = [_policy(0.6) for _ in range(4)]
    trusted = sum(plan_batch(policies, [100] * 4, cost))
    halved = sum(plan_batch(policies, [100] * 4, cost, calibration=[0.5] * 4))
    assert trusted > halved
    assert plan_batch(policies, [100] * 4, cost, calibration=[0.25] * 4) == [0] * 4
    alone = plan_batch(policies[:1], [100], cost)
    assert plan_batch(policies[:1], [100], cost, calibration=[0.25]) == alone


def test_calibration_is_accepted_over_promised_drafts() -> None:
    prior = SpeculationPrior()
    assert prior.calibration == 1.0  # nothing promised yet
    prior.record(1.0, 0)
    assert prior.calibration == 1.0  # too little to go by
    for _ in range(20):
        prior.record(1.5, 1)
    assert prior.calibration == pytest.approx(1 / 1.5, rel=0.05)
    for _ in range(300):
        prior.record(2.0, 0)  # promised much, accepted nothing: floored
    assert prior.calibration == MIN_CALIBRATION
    for _ in range(300):
        prior.record(1.0, 3)  # better than promised: the rates are used as they are
    assert prior.calibration == 1.0


def test_plan_batch_respects_limits_and_missing_drafters() -> None:
    cost = _cost(0.060, 0.001)
    ks = plan_batch([_policy(0.95), None, _policy(0.95)], [2, 50, 0], cost)
    assert ks[0] <= 2 and ks[1] == 0 and ks[2] == 0


def test_a_backed_off_sequence_probes_again() -> None:
    cost = _cost(0.060, 0.050)  # verifying is as dear as decoding: never speculate
    policy = _policy(0.2)
    seen = []
    for _ in range(40):
        k = plan_batch([policy], [100], cost)[0]
        seen.append(k)
        policy.update(k, 0)
    assert 0 < sum(seen) <= 3


def test_one_stream_weighs_whole_drafts_past_the_one_token_jump() -> None:
    """On a CPU a one-token pass is much cheaper than a two-token one, while each
    further token costs little: one stream drafts several tokens when they are likely
    kept (one token alone would not pay), and none when they are not."""
    cost = StepCost()
    for _ in range(5):
        for tokens in (2, 3, 5, 9):
            cost.observe(tokens, 0.060 + 0.002 * tokens)
        cost.observe(1, 0.045)
    assert cost.predict(1) == pytest.approx(0.045)
    assert cost.predict(5) == pytest.approx(0.070, rel=0.05)
    assert plan_batch([_policy(0.8)], [100], cost)[0] >= 3
    assert plan_batch([_policy(0.2)], [100], cost) == [0]
