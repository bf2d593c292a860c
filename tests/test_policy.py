from __future__ import annotations

import pytest

from decoding.policy import (
    MAX_DRAFT_TOKENS,
    PROBE_INTERVAL,
    AdaptiveSpeculation,
    FixedSpeculation,
    RoundCost,
    SpeculationPrior,
)


def test_grows_on_full_acceptance_up_to_the_bound() -> None:
    policy = AdaptiveSpeculation()
    start = policy.next_k(100)
    for _ in range(20):
        k = policy.next_k(100)
        policy.update(k, k)
    assert policy.next_k(100) > start
    assert policy.next_k(100) == MAX_DRAFT_TOKENS


def test_shrinks_on_early_rejection_and_backs_off_to_plain() -> None:
    policy = AdaptiveSpeculation()
    ks = []
    for _ in range(24):  # a free drafter's rejected tokens cost only their verification
        k = policy.next_k(100)
        ks.append(k)
        if k:
            policy.update(k, 0)
        else:
            policy.update(0, 0)
    assert ks[0] > ks[1] or ks[1] == 0
    assert ks[-1] == 0, "poor acceptance falls back to plain decoding"


def test_probes_again_after_backing_off() -> None:
    policy = AdaptiveSpeculation()
    for _ in range(10):
        k = policy.next_k(100)
        policy.update(k, 0)
    ks = []
    for _ in range(PROBE_INTERVAL + 2):
        k = policy.next_k(100)
        ks.append(k)
        policy.update(k, k)  # drafts would now be accepted
    assert any(ks), "a probe round happens after PROBE_INTERVAL plain rounds"
    assert policy.next_k(100) > 0, "good probes bring speculation back"


def test_respects_limit_and_cap() -> None:
    policy = AdaptiveSpeculation(max_tokens=3)
    for _ in range(10):
        k = policy.next_k(100)
        policy.update(k, k)
    assert policy.next_k(100) == 3
    assert policy.next_k(2) == 2
    assert policy.next_k(0) == 0


def test_expensive_drafts_need_higher_acceptance() -> None:
    cheap, dear = AdaptiveSpeculation(), AdaptiveSpeculation(cost=RoundCost(draft_per_token=0.5))
    for policy in (cheap, dear):
        for i in range(20):  # half the drafts wholly right, half wrong from the start
            policy.update(4, 4 if i % 2 else 0)
    assert cheap.best_k() >= 4
    assert dear.best_k() < cheap.best_k()


def test_runs_of_acceptance_favour_long_drafts() -> None:
    """Drafts that are either wholly right or wrong at once (n-gram copies) earn a
    longer k than one per-token rate would give them."""
    policy = AdaptiveSpeculation()
    for i in range(30):
        policy.update(4, 4 if i % 2 else 0)
    rates = policy.acceptance.rates()
    assert 0.3 < rates[0] < 0.7 and min(rates[1:4]) > 0.9
    assert policy.best_k() == MAX_DRAFT_TOKENS


def test_new_requests_start_from_what_earlier_ones_learned() -> None:
    def finished(accepted: int) -> AdaptiveSpeculation:
        policy = AdaptiveSpeculation()
        for _ in range(20):
            policy.update(4, accepted)
        return policy

    prior = SpeculationPrior()
    fresh = prior.new_policy()
    assert not prior.known and fresh.k == AdaptiveSpeculation().k  # nothing learned yet
    for _ in range(3):
        prior.observe(finished(0))  # a drafter that is never right
    poor = prior.new_policy()
    assert poor.k == 1 and poor.alpha < 0.2  # measures itself with one token, no more
    for _ in range(10):
        prior.observe(finished(4))  # the same drafter on text it predicts well
    good = prior.new_policy()
    assert good.k >= 6 and good.alpha > 0.8
    good.update(4, 0)  # its own rounds soon count more than the head start
    good.update(4, 0)
    assert good.alpha < 0.6


# -- a drafter that says how sure it is ---------------------------------------------------


def _overconfident(policy: AdaptiveSpeculation, rounds: int = 40) -> AdaptiveSpeculation:
    """Rounds of one draft token at confidence 0.95, accepted one time in three."""
    for i in range(rounds):
        policy.update(1, 1 if i % 3 == 0 else 0, confidences=(0.95,))
    return policy


def test_confidence_is_calibrated_against_verification() -> None:
    policy = AdaptiveSpeculation()
    assert policy.calibration.accept_chance(0.95) == pytest.approx(0.95)  # its own word, at first
    _overconfident(policy)
    assert 0.25 < policy.calibration.accept_chance(0.95) < 0.45
    assert policy.calibration.accept_chance(0.35) == pytest.approx(0.35)  # unmeasured there
    assert not policy.worth_proposing([0.95, 0.95, 0.95, 0.95])


def _calibrated(policy: AdaptiveSpeculation) -> AdaptiveSpeculation:
    """Rounds of one draft token in every tenth of confidence, accepted about as often as
    its confidence says (a bin's midpoint)."""
    for j in range(10):
        for b in range(10):
            mid = (b + 0.5) / 10
            kept = int((j + 1) * mid) > int(j * mid)  # spread evenly over the rounds
            policy.update(1, 1 if kept else 0, confidences=(mid,))
    return policy


def test_a_round_drafts_as_far_as_its_tokens_are_worth_verifying() -> None:
    policy = _calibrated(AdaptiveSpeculation())
    assert policy.calibration.accept_chance(0.35) == pytest.approx(0.35, abs=0.1)
    assert policy.worth_proposing([0.95]) and not policy.worth_proposing([0.02])
    assert policy.worth_proposing([0.95, 0.95, 0.95, 0.95, 0.95])
    assert policy.worth_proposing([0.35] * 3) and not policy.worth_proposing([0.35] * 4)
    # before paying for another token: not when the round's chance is already small
    assert policy.worth_continuing([0.35, 0.35]) and not policy.worth_continuing([0.35] * 3)
    dear = _calibrated(AdaptiveSpeculation(cost=RoundCost(draft_per_token=0.5)))  # half a step
    assert policy.worth_continuing([0.55]) and not dear.worth_continuing([0.55])
    fixed = FixedSpeculation(4)  # measuring a drafter: every token, whatever its confidence
    assert fixed.worth_proposing([0.01]) and fixed.worth_continuing([0.01])


def test_confidences_verification_has_not_measured_are_proposed_to_measure_them() -> None:
    """A drafter that undersells itself is verified, so corrected, not silenced."""
    shy = AdaptiveSpeculation()
    assert shy.worth_proposing([0.05])  # nothing measured at 0.05 yet
    for _ in range(5):
        shy.update(1, 1, confidences=(0.05,))  # ... and such tokens are always accepted
    assert shy.calibration.accept_chance(0.05) > 0.6
    assert shy.worth_proposing([0.05, 0.05, 0.05]) and shy.worth_continuing([0.05, 0.05])
    poor = AdaptiveSpeculation()
    for _ in range(5):
        poor.update(1, 0, confidences=(0.05,))  # ... always rejected
    assert not poor.worth_proposing([0.05])


def test_a_confident_drafter_sets_its_own_length_and_backs_off_when_it_does_not_pay() -> None:
    policy = AdaptiveSpeculation()
    policy.update(2, 2, confidences=(0.9, 0.9, 0.4))  # two proposed, the third withheld
    assert policy.confident and policy.next_k(100) == MAX_DRAFT_TOKENS
    assert policy.next_k(3) == 3
    dear = AdaptiveSpeculation(cost=RoundCost(draft_per_token=0.5))
    for _ in range(5):  # unsure, rejected, and dear to run
        dear.update(1, 0, confidences=(0.2, 0.1))
    assert dear.next_k(100) == 0
    ks = []
    for _ in range(PROBE_INTERVAL + 1):
        k = dear.next_k(100)
        ks.append(k)
        if k == 0:
            dear.update(0, 0)
    assert ks[-1] == MAX_DRAFT_TOKENS and not any(ks[:-1])  # a probe, as far as it is sure


def test_a_rounds_withheld_token_and_the_first_rounds_prompt_feed_are_priced_right() -> None:
    policy = AdaptiveSpeculation()
    policy.update(0, 0, verify_s=0.05)  # a plain round: one step takes 50 ms
    # the draft's first round also fed it the prompt: not what a draft step costs
    policy.update(1, 1, draft_s=0.5, verify_s=0.05, confidences=(0.9, 0.2))
    assert policy.cost.draft_per_token == 0.0
    policy.update(0, 0, draft_s=0.005, verify_s=0.05, confidences=(0.1,))  # withheld: one step
    assert policy.cost.draft_per_token == pytest.approx(0.1, rel=0.05)
    assert policy.drafted_rounds == 1 and policy.confident_rounds == 2


def test_new_requests_inherit_the_calibration() -> None:
    prior = SpeculationPrior()
    for _ in range(3):
        prior.observe(_overconfident(AdaptiveSpeculation()))
    fresh = prior.new_policy()
    assert fresh.confident and fresh.next_k(100) == MAX_DRAFT_TOKENS
    assert fresh.calibration.accept_chance(0.95) < 0.5


def test_an_alternative_is_verified_while_it_is_taken_often_enough_to_pay() -> None:
    """The drafter's second choice for the first token costs one verified token and adds
    one when taken: worth it at about the drafter's probability for it, corrected by how
    often alternatives were taken lately."""
    p = AdaptiveSpeculation()
    assert p.worth_alternative([0.5], 0.05)
    assert not p.worth_alternative([0.5], 0.01)  # below a verified token's cost
    assert p.alternatives.chance(0.3) == pytest.approx(0.3)  # the drafter's word, at first
    for _ in range(30):  # never taken
        p.update(1, 0, 0.01, 0.05, [0.5], alternative=0.3, alternative_taken=False)
    assert p.alternatives.verified == 30 and p.alternatives.taken == 0
    assert p.alternatives.chance(0.3) < 0.1
    assert not p.worth_alternative([0.5], 0.05)
    for _ in range(60):  # taken every time: trusted again, and beyond its word
        p.update(1, 0, 0.01, 0.05, [0.5], alternative=0.3, alternative_taken=True)
    assert p.alternatives.taken == 60
    assert p.alternatives.chance(0.3) > 0.3 and p.worth_alternative([0.5], 0.3)
    assert not FixedSpeculation(4).worth_alternative([0.5], 0.9)  # a fixed chain: never


def test_new_requests_inherit_how_often_alternatives_were_taken() -> None:
    prior = SpeculationPrior()
    assert prior.new_policy().alternatives.calibration == pytest.approx(1.0)
    old = AdaptiveSpeculation()
    for _ in range(40):  # a confident drafter whose alternatives are taken a third as often
        old.update(1, 1, 0.01, 0.05, [0.9], alternative=0.3, alternative_taken=False)
        old.update(1, 1, 0.01, 0.05, [0.9], alternative=0.3, alternative_taken=False)
        old.update(1, 0, 0.01, 0.05, [0.9], alternative=0.3, alternative_taken=True)
    assert 0.8 < old.alternatives.calibration < 1.4
    for _ in range(3):
        slow = AdaptiveSpeculation()
        for _ in range(40):
            slow.update(1, 1, 0.01, 0.05, [0.9], alternative=0.6, alternative_taken=False)
            slow.update(1, 1, 0.01, 0.05, [0.9], alternative=0.6, alternative_taken=True)
            slow.update(1, 1, 0.01, 0.05, [0.9], alternative=0.6, alternative_taken=False)
        prior.observe(slow)
    new = prior.new_policy()
    assert new.alternatives.calibration == pytest.approx(slow.alternatives.calibration, rel=0.05)
    assert new.alternatives.calibration < 0.7 and new.alternatives.verified == 0


def test_the_shared_line_fit_recovers_a_line_and_forgets_old_points() -> None:
    from decoding.policy.cost import LineFit, StepCost, VerifyCost

    fit = LineFit()
    for x in range(1, 9):
        fit.add(x, 0.010 + 0.002 * x, 1.0)
    mean_x, mean_y, slope = fit.fit()
    assert slope == pytest.approx(0.002) and mean_y - slope * mean_x == pytest.approx(0.010)
    for _ in range(400):  # the machine got twice as slow: the old points fade
        fit.decay(0.97)
        for x in (1, 8):
            fit.add(x, 2 * (0.010 + 0.002 * x), 1.0)
    assert fit.fit()[2] == pytest.approx(0.004, rel=1e-3)
    # both cost models read the same fit: a pass of 1 + k tokens against k verified
    step, verify = StepCost(), VerifyCost()
    for k in [0, 2, 4, 6, 3, 5] * 50:  # enough rounds that the starting prior has faded
        seconds = 0.010 * (1 + 0.05 * k)
        step.observe(1 + k, seconds)
        verify.observe(k, seconds)
    fixed, per_token = step.line()
    assert fixed == pytest.approx(0.0095, rel=1e-2) and per_token == pytest.approx(0.0005, rel=1e-2)
    assert verify.per_token == pytest.approx(0.05, rel=1e-2)
    assert verify.step_s == pytest.approx(0.010, rel=1e-2)


# -- what the policy decides from, each alone ----------------------------------------------


def test_position_acceptance_counts_the_positions_up_to_the_first_rejection() -> None:
    from decoding.policy import INITIAL_ALPHA, PositionAcceptance

    fresh = PositionAcceptance()
    assert fresh.rates() == pytest.approx([INITIAL_ALPHA] * MAX_DRAFT_TOKENS)  # inherited
    acceptance = PositionAcceptance()
    acceptance.record(drafted=4, accepted=1)  # position 0 kept, 1 rejected, 2 and 3 unseen
    assert [t > 0 for t in acceptance.tries] == [True, True] + [False] * (MAX_DRAFT_TOKENS - 2)
    assert acceptance.hits[1] == 0 and acceptance.hits[0] > fresh.hits[0]
    for i in range(40):  # whole runs: a draft is right throughout or wrong from the start
        acceptance.record(4, 4 if i % 2 else 0)
    rates = acceptance.rates()
    assert 0.3 < rates[0] < 0.7 and min(rates[1:4]) > 0.85
    measured = [0.9, 0.7, 0.5, 0.4, 0.3, 0.3, 0.2, 0.2]
    started = PositionAcceptance.starting_at(measured).rates()
    assert len(started) == MAX_DRAFT_TOKENS
    assert started[: len(measured)] == pytest.approx(measured, abs=0.05)
    assert started[len(measured):] == pytest.approx(
        [measured[-1]] * (MAX_DRAFT_TOKENS - len(measured)), abs=0.05)


def test_confidence_calibration_leans_on_the_drafter_s_word_until_measured() -> None:
    from decoding.policy import INITIAL_ALPHA, ConfidenceCalibration

    calibration = ConfidenceCalibration()
    assert calibration.accept_chance(0.72) == pytest.approx(0.72)
    assert not calibration.measured(0.72)
    assert calibration.mean_acceptance() == pytest.approx(INITIAL_ALPHA)
    for _ in range(30):  # tokens at 0.72 are never accepted; the one after is never verified
        calibration.record(drafted=2, accepted=0, confidences=(0.72, 0.15))
    assert calibration.measured(0.72) and calibration.accept_chance(0.72) < 0.1
    assert not calibration.measured(0.15) and calibration.accept_chance(0.15) == 0.15
    curve = calibration.curve()
    assert len(curve) == 10 and curve[7] < 0.1 and curve[2] == pytest.approx(0.25)
    assert calibration.mean_acceptance() < 0.2
    inherited = ConfidenceCalibration(base=[0.5] * 10)  # what earlier requests measured
    assert inherited.accept_chance(0.95) == pytest.approx(0.5)


def test_alternative_calibration_follows_how_often_alternatives_are_taken() -> None:
    from decoding.policy import AlternativeCalibration

    alternatives = AlternativeCalibration()
    assert alternatives.chance(0.4) == pytest.approx(0.4)  # the drafter's word, at first
    for i in range(40):  # promised 0.5 each, taken one time in four
        alternatives.record(0.5, taken=i % 4 == 0)
    assert (alternatives.verified, alternatives.taken) == (40, 10)
    assert 0.4 < alternatives.calibration < 0.65
    assert alternatives.chance(0.4) < 0.3
    assert AlternativeCalibration(base=5.0).chance(0.5) == 1.0  # a chance, never more


def test_round_cost_prices_drafting_in_target_steps_after_the_prompt_s_round() -> None:
    cost = RoundCost()
    assert cost.per_token == pytest.approx(cost.verify.prior)
    cost.observe(verified=0, steps=0, draft_s=0.0, verify_s=0.05)  # a plain round: 50 ms
    cost.observe(verified=2, steps=2, draft_s=1.0, verify_s=0.05)  # fed the prompt too
    assert cost.draft_per_token == 0.0 and cost.draft_s_per_token == 0.0
    cost.observe(verified=2, steps=2, draft_s=0.01, verify_s=0.05)  # 5 ms a draft step
    assert cost.draft_s_per_token == pytest.approx(0.005)
    assert cost.draft_per_token == pytest.approx(0.005 / cost.verify.step_s)
    assert cost.per_token == pytest.approx(cost.verify.per_token + cost.draft_per_token)
    before = (cost.draft_per_token, cost.draft_s_per_token)
    cost.observe(verified=0, steps=0, draft_s=0.5, verify_s=0.05)  # no draft step: no price
    assert (cost.draft_per_token, cost.draft_s_per_token) == before
