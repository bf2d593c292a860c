from __future__ import annotations

from decoding.policy import (
    MAX_DRAFT_TOKENS,
    PROBE_INTERVAL,
    AdaptiveSpeculation,
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
    for _ in range(12):
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
    cheap, dear = AdaptiveSpeculation(), AdaptiveSpeculation(draft_cost_per_token=0.5)
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
    rates = policy.position_rates()
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
