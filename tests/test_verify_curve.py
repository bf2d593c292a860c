"""The verify curve: what a pass of k draft tokens costs, measured on a real target, and
how the draft-length policy prices rounds by it."""

from __future__ import annotations

from typing import Any

import pytest

from decoding.engine import Engine
from decoding.policy import MAX_DRAFT_TOKENS, AdaptiveSpeculation, SpeculationPrior
from decoding.policy.cost import VerifyCost, VerifyCurve
from decoding.policy.curve import describe, draft_cost, from_seconds, measure
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import BatchItem


def _line(slope: float, most: int = MAX_DRAFT_TOKENS) -> VerifyCurve:
    return VerifyCurve(tuple(1 + slope * k for k in range(most + 1)))


def test_the_ceiling_is_the_formula_at_its_best_length() -> None:
    curve = _line(0.2)
    k, gain = curve.ceiling(0.8, 0.45)
    by_hand = max((1 - 0.8 ** (j + 1)) / ((1 - 0.8) * (j * 0.45 + 1 + 0.2 * j))
                  for j in range(1, MAX_DRAFT_TOKENS + 1))
    assert gain == pytest.approx(by_hand)
    assert (1 - 0.8 ** (k + 1)) / (0.2 * (k * 0.45 + 1 + 0.2 * k)) == pytest.approx(by_hand)
    assert 1.0 < gain < 1.2  # a 0.5B drafting for a 1.5B on two cores: little to gain
    assert curve.ceiling(0.6, 0.45) == (0, 1.0)  # below break-even: plain decoding
    free_k, free_gain = curve.ceiling(0.9, 0.0)  # lookup at high acceptance
    assert free_gain > 2.3 and free_k >= 5


def test_a_curve_grows_by_its_last_step_past_its_end() -> None:
    curve = VerifyCurve((1.0, 1.1, 1.3))
    assert [curve.at(k) for k in range(5)] == pytest.approx([1.0, 1.1, 1.3, 1.5, 1.7])
    assert VerifyCost(curve=curve).marginal(2) == pytest.approx(0.2)
    assert VerifyCost(curve=curve).steps(4) == pytest.approx(1.7)


def test_the_first_steps_are_read_from_the_table() -> None:
    """V(1), V(2), V(3) and the marginal cost between them come from the measured table,
    not its tail's slope: a curve whose first draft token is nearly free and whose second
    costs a sweep of the weights."""
    curve = from_seconds([0.020, 0.021, 0.025, 0.026, 0.027])
    assert curve.steps == pytest.approx((1.0, 1.05, 1.25, 1.3, 1.35))
    assert [curve.at(k) for k in range(4)] == pytest.approx([1.0, 1.05, 1.25, 1.3])
    cost = VerifyCost(curve=curve)
    assert [cost.steps(k) for k in range(4)] == pytest.approx([1.0, 1.05, 1.25, 1.3])
    assert [cost.marginal(k) for k in (1, 2, 3)] == pytest.approx([0.05, 0.2, 0.05])
    # a drafter whose second token pays only where the second step is cheap
    assert VerifyCurve((1.0, 1.0, 3.0, 5.0)).ceiling(0.5, 0.0) == (1, pytest.approx(1.5))
    assert VerifyCurve((1.0, 1.0, 1.0, 5.0)).ceiling(0.5, 0.0) == (
        2, pytest.approx((1 - 0.5 ** 3) / 0.5))


def test_timings_make_a_monotone_curve_from_one() -> None:
    curve = from_seconds([0.04, 0.05, 0.048, 0.06])
    assert curve.steps == (1.0, 1.25, 1.25, 1.5)
    with pytest.raises(ValueError):
        from_seconds([0.0, 0.1])


def test_the_policy_stops_short_of_a_step_in_the_curve() -> None:
    """A pass of 9 tokens reads the weights twice where products serve 8 tokens a sweep:
    at high acceptance the policy drafts 7 and not 8, where the line would say 8 or more."""
    steps = tuple(1 + 0.05 * k + (1.0 if k + 1 > 8 else 0.0) for k in range(17))
    stepped, line = AdaptiveSpeculation(), AdaptiveSpeculation()
    stepped.cost.verify = VerifyCost(curve=VerifyCurve(steps))
    line.cost.verify = VerifyCost(prior=0.05)
    for policy in (stepped, line):
        for _ in range(30):
            k = policy.next_k(100)
            policy.update(k, max(0, k - 1) if k > 7 else k)  # runs of about 8 kept
    assert stepped.best_k() == 7
    assert line.best_k() > 7


def test_new_policies_start_from_the_measured_curve() -> None:
    curve = _line(0.3)
    policy = SpeculationPrior(curve=curve).new_policy()
    assert policy.cost.verify.curve is curve
    assert policy.cost.steps(4) == pytest.approx(curve.at(4))


def test_a_real_target_measures_a_curve_and_its_ceilings(default_target: CausalLM) -> None:
    curve = measure(default_target, most=4, repeats=1)
    assert len(curve.steps) == 5 and curve.steps[0] == 1.0
    assert all(b >= a for a, b in zip(curve.steps, curve.steps[1:], strict=False))
    shown = describe(curve, {"lookup": 0.0, "draft": 0.45})
    assert shown["verify_steps"] == list(curve.steps)
    assert set(shown["ceiling"]) == {"lookup", "draft"}
    assert shown["ceiling"]["lookup"]["0.90"]["speedup"] >= shown["ceiling"]["draft"]["0.90"][
        "speedup"]


class _Recorded:
    """The real target, its passes recorded: (tokens, logits kept, length before)."""

    def __init__(self, target: CausalLM) -> None:
        self.target = target
        self.vocab_size = target.vocab_size
        self.passes: list[tuple[tuple[int, ...], int, int]] = []

    def new_state(self) -> Any:
        return self.target.new_state()

    def forward_batch(self, items: list[BatchItem[Any]]) -> Any:
        (item,) = items
        self.passes.append((tuple(item.token_ids), item.keep, item.state.length))
        return self.target.forward_batch(items)

    def rollback(self, state: Any, length: int) -> None:
        self.target.rollback(state, length)

    def release(self, state: Any) -> None:
        self.target.release(state)


def test_measure_times_passes_of_1_to_k_plus_1_tokens_after_the_context(
        tiny_target: CausalLM) -> None:
    """Each timed pass appends k + 1 tokens to the same 256-token context (rolled back
    before every repeat), keeps every position's logits, and the curve is each pass's
    median time over the one-token pass's, from an injected clock."""
    durations = {0: [0.020, 0.030, 0.020], 1: [0.021, 0.021, 0.5], 2: [0.025, 0.025, 0.025]}
    readings: list[float] = []
    now = 100.0
    for k in range(3):
        for d in durations[k]:
            readings += [now, now + d]
            now += 1.0
    clock = iter(readings)
    recorded = _Recorded(tiny_target)
    curve = measure(recorded, most=2, repeats=3, clock=lambda: next(clock))  # type: ignore[arg-type]
    assert curve.steps == pytest.approx((1.0, 1.05, 1.25))
    assert curve.step_s == pytest.approx(0.020)
    prefill, *timed = recorded.passes
    assert len(prefill[0]) == 256 and prefill[1:] == (1, 0)
    assert [(len(t), keep, before) for t, keep, before in timed] == [
        (k + 1, k + 1, 256) for k in range(3) for _ in range(3)]
    assert all(isinstance(t, int) and 0 <= t < tiny_target.vocab_size
               for tokens, _, _ in recorded.passes for t in tokens)


def test_the_profile_shows_its_figures_rounded_under_their_names() -> None:
    """What ``/v1/models`` shows: the step in milliseconds to 3 places, the steps to 4, each
    drafter's cost to 4, and per acceptance the best length and its speed-up to 3."""
    curve = from_seconds([0.03, 0.031, 0.0315])
    assert curve.steps == (1.0, 1.0333, 1.05)
    shown = describe(curve, {"lookup": 0.0123456}, acceptances=(0.8,))
    k, speedup = curve.ceiling(0.8, 0.0123456)
    assert shown == {"step_ms": 30.0, "verify_steps": [1.0, 1.0333, 1.05],
                     "draft_cost": {"lookup": 0.0123},
                     "ceiling": {"lookup": {"0.80": {"k": k, "speedup": round(speedup, 3)}}}}
    assert speedup != round(speedup, 3)  # so that the rounding shows
    assert describe(VerifyCurve((1.0,), 0.0123456), {})["step_ms"] == 12.346
    with pytest.raises(ValueError, match=r"^a verify curve needs a one-token pass of positive"):
        from_seconds([])
    with pytest.raises(ValueError, match=r"^the target's curve has no measured step$"):
        draft_cost(None, VerifyCurve((1.0,)))  # type: ignore[arg-type]


def test_a_model_source_starts_from_its_measured_step() -> None:
    from decoding.kv_budget import KvBudget
    from decoding.scheduler import Scheduler
    from tests.test_kv_budget import PoolTarget

    scheduler = Scheduler(KvBudget(PoolTarget(limit=None), None), max_active=4)
    scheduler.verify_curve = _line(0.2)
    scheduler.draft_costs["ngram+draft"] = 0.45
    model = scheduler.new_policy("ngram+draft", "model")
    lookup = scheduler.new_policy("ngram+draft", "lookup")
    assert model.cost.draft_per_token == 0.45 and lookup.cost.draft_per_token == 0.0
    assert model.cost.steps(3) == pytest.approx(1.6 + 3 * 0.45)
    # at the acceptance a 0.5B reaches on chat (about 0.6), such a draft does not pay:
    # plain decoding; a free drafter at the same acceptance does
    for i in range(40):
        for policy in (model, lookup):
            k = max(policy.next_k(100), 1)
            policy.update(k, 1 if i % 5 < 3 else 0)
    assert model.best_k() == 0 and lookup.best_k() >= 1


def test_a_stored_curve_reaches_the_scheduler_and_profile_as_a_measured_one(
        tiny_target: CausalLM, tiny_draft: CausalLM) -> None:
    """An engine given a curve and draft costs measured before prices rounds and shows its
    profile exactly as the engine that measured them."""
    measured = Engine(tiny_target, {})
    curve, costs = measured.measure_verify_curve({"draft": tiny_draft})
    assert set(costs) == {"draft"} and costs["draft"] > 0
    taken = Engine(tiny_target, {})
    assert taken.measure_verify_curve(stored=(curve, costs)) == (curve, costs)
    assert taken.scheduler.verify_curve == measured.scheduler.verify_curve == curve
    assert taken.scheduler.draft_costs == measured.scheduler.draft_costs == costs
    assert taken.speculation_profile == measured.speculation_profile
    assert taken.speculation_profile is not None
    assert taken.speculation_profile["draft_cost"]["lookup"] == 0.0


class _Counted:
    """A model-free target of a given vocabulary: its passes recorded as (tokens, logits
    kept, length before), its state the sequence's length."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.passes: list[tuple[tuple[int, ...], int, int]] = []

    def new_state(self) -> list[int]:
        return [0]

    def forward_batch(self, items: list[BatchItem[Any]]) -> list[Any]:
        (item,) = items
        self.passes.append((tuple(item.token_ids), item.keep, item.state[0]))
        item.state[0] += len(item.token_ids)
        return []

    def rollback(self, state: list[int], length: int) -> None:
        state[0] = length

    def release(self, state: list[int]) -> None:
        pass


def test_a_two_token_vocabulary_is_fed_only_its_own_tokens() -> None:
    target = _Counted(vocab_size=2)
    ticks = iter(range(1, 1000))
    measure(target, most=3, repeats=1, clock=lambda: float(next(ticks)))  # type: ignore[arg-type]
    fed = [t for tokens, _, _ in target.passes for t in tokens]
    assert set(fed) == {0, 1}


def test_a_draft_cost_times_one_token_passes_in_the_target_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft is timed as a target with no draft of its own: after the context,
    ``repeats`` one-token passes, each from the context's end; its step is then divided by
    the target's, so the same draft costs more steps beside a faster target (a clock that
    ticks once a call: every timed pass takes exactly 1 s)."""
    from decoding.policy import curve

    ticks = iter(range(1, 10_000))
    timed_measure = curve.measure

    def ticking(target: Any, most: int, repeats: int) -> VerifyCurve:
        return timed_measure(target, most=most, repeats=repeats,
                             clock=lambda: float(next(ticks)))

    monkeypatch.setattr(curve, "measure", ticking)
    draft = _Counted(vocab_size=50)
    assert curve.draft_cost(draft, VerifyCurve((1.0,), 1.0), repeats=2) == 1.0  # type: ignore[arg-type]
    prefill, *timed = draft.passes
    assert len(prefill[0]) == 256 and prefill[1:] == (1, 0)
    assert [(len(tokens), keep, before) for tokens, keep, before in timed] == [
        (1, 1, 256), (1, 1, 256)]
    assert curve.draft_cost(draft, VerifyCurve((1.0,), 4.0)) == 0.25  # type: ignore[arg-type]
    assert curve.draft_cost(draft, VerifyCurve((1.0,), 0.5)) == 2.0  # type: ignore[arg-type]
