"""The scheduler alone, with no model and no model thread: which waiting requests join
under the KV budget and in what order, which have waited past their deadline, how far each
stream drafts as the batch grows, and what finished requests teach about each drafter and
source."""

from __future__ import annotations

from collections.abc import Callable

from decoding.kv_budget import KvBudget
from decoding.policy import MIN_CALIBRATION, AdaptiveSpeculation
from decoding.scheduler import RunningStream, Scheduler
from decoding.streams import RequestStream
from decoding.types import GenerationRequest
from runtime.runner.passes import BLOCK
from tests.batching import _cost, _policy
from tests.clocks import ManualClock
from tests.test_kv_budget import PoolTarget


def _stream(prompt: int, max_new_tokens: int = 10_000, *, at: float = 0.0,
            timeout_s: float | None = None, drafter: str | None = None) -> RequestStream:
    """A waiting request of a ``prompt``-token prompt: ``max_new_tokens`` takes no room."""
    request = GenerationRequest(prompt_ids=tuple(range(1, prompt + 1)),
                                max_new_tokens=max_new_tokens, timeout_s=timeout_s)
    return RequestStream(request=request, drafter=drafter, submitted_at=at)


def _scheduler(max_active: int = 16, *, batch_planning: bool = True, batched: bool = True,
               clock: Callable[[], float] | None = None) -> Scheduler:
    """A scheduler over a target with a pool of 100 blocks."""
    return Scheduler(KvBudget(PoolTarget(limit=100), 100 * 160), max_active, batch_planning,
                     batched, clock or ManualClock())


# -- admission -----------------------------------------------------------------------


def test_every_request_joins_in_order_while_its_prompt_s_blocks_are_free() -> None:
    """A request takes its prompt's blocks and a margin, whatever answer it may give."""
    waiting = [_stream(10 * BLOCK), _stream(5), _stream(2 * BLOCK + 1)]  # 11, 2 and 4 blocks
    joining = _scheduler().admit(waiting, 0, 17)
    assert [a.stream for a in joining] == waiting
    assert [a.blocks for a in joining] == [11, 2, 4]


def test_the_first_request_that_does_not_fit_waits_and_so_do_those_behind_it() -> None:
    """Room for two prompts of 10 blocks: the third waits, and the small fourth does not
    overtake it."""
    waiting = [_stream(9 * BLOCK), _stream(9 * BLOCK), _stream(9 * BLOCK), _stream(1)]
    scheduler = _scheduler()
    assert [a.stream for a in scheduler.admit(waiting, 1, 20)] == waiting[:2]
    assert [a.stream for a in scheduler.admit(waiting, 1, 19)] == waiting[:1]
    assert scheduler.admit(waiting, 1, 9) == []
    assert [a.stream for a in scheduler.admit(waiting[3:], 1, 2)] == waiting[3:]
    assert scheduler.admit([waiting[0], waiting[3]], 1, 2) == []  # no overtaking


def test_one_request_always_joins_when_none_runs() -> None:
    huge = _stream(50 * BLOCK)
    assert [a.stream for a in _scheduler().admit([huge], 0, 3)] == [huge]
    assert _scheduler().admit([huge], 1, 3) == []


def test_no_more_join_than_max_active() -> None:
    waiting = [_stream(2) for _ in range(5)]
    scheduler = _scheduler(max_active=3)
    assert [a.stream for a in scheduler.admit(waiting, 0, None)] == waiting[:3]
    assert [a.stream for a in scheduler.admit(waiting, 2, None)] == waiting[:1]
    assert scheduler.admit(waiting, 3, None) == []


def test_a_cancelled_request_joins_to_be_dropped_and_takes_no_room() -> None:
    waiting = [_stream(9 * BLOCK), _stream(9 * BLOCK), _stream(9 * BLOCK)]
    waiting[0].cancel()
    joining = _scheduler(max_active=2).admit(waiting, 0, 20)
    assert [a.stream for a in joining] == waiting  # the two live ones still fit
    assert _scheduler(max_active=2).admit(waiting[1:], 1, 9) == []


def test_a_request_waits_past_its_deadline_on_the_scheduler_clock() -> None:
    clock = ManualClock()
    scheduler = _scheduler(clock=clock)
    patient = _stream(3, 3, at=0.0)  # no deadline
    short = _stream(3, 3, at=1.0, timeout_s=2.0)  # ends at 3.0
    long = _stream(3, 3, at=0.0, timeout_s=10.0)
    waiting = [patient, short, long]
    clock.now = 3.0
    assert scheduler.expired(waiting) == []  # at its deadline, not past it
    clock.now = 3.5
    assert scheduler.expired(waiting) == [short]
    clock.now = 10.5
    assert scheduler.expired(waiting) == [short, long]
    deadlines = {id(a.stream): a.deadline for a in scheduler.admit(waiting, 0, None)}
    assert deadlines == {id(patient): None, id(short): 3.0, id(long): 10.0}


# -- the batch plan ------------------------------------------------------------------


def _drafting(rate: float, drafter: str | None = "ngram", source: str = "") -> RunningStream:
    return RunningStream(drafter, source, _policy(rate) if drafter else None, limit=100)


def test_speculation_shrinks_as_the_batch_grows() -> None:
    """Once a pass's time is measured, one stream drafts long, a big batch little, and
    past the point where plain batched decoding is faster, not at all."""
    scheduler = _scheduler()
    scheduler.step_cost = _cost(0.060, 0.004)  # a draft token costs 1/15 of a step
    per_stream = []
    for n in (1, 4, 16, 64):
        plan = scheduler.plan([_drafting(0.5) for _ in range(n)])
        assert all(k is not None and 0 <= k <= 100 for k in plan)
        per_stream.append(sum(k or 0 for k in plan) / n)
    assert per_stream[0] >= 1
    assert per_stream == sorted(per_stream, reverse=True) and per_stream[0] > per_stream[-1]
    assert scheduler.plan([_drafting(0.5) for _ in range(64)]) == [0] * 64


def test_without_a_batch_to_plan_each_stream_drafts_as_its_policy_says() -> None:
    batch = [_drafting(0.9), _drafting(0.9)]
    assert _scheduler(batch_planning=False).plan(batch) == [None, None]
    assert _scheduler(batched=False).plan(batch) == [None, None]  # one sequence a pass
    assert _scheduler().plan([_drafting(0.9, drafter=None)] * 3) == [None] * 3  # none drafts
    mixed = _scheduler().plan([_drafting(0.9), _drafting(0.9, drafter=None)])
    assert mixed[0] is not None and mixed[1] == 0  # a stream with no drafter drafts nothing


def test_a_stream_drafts_no_further_than_its_limit() -> None:
    scheduler = _scheduler()
    scheduler.step_cost = _cost(0.060, 0.001)
    plan = scheduler.plan([RunningStream("ngram", "", _policy(0.95), limit=2),
                           RunningStream("ngram", "", _policy(0.95), limit=0)])
    assert plan[0] is not None and 0 < plan[0] <= 2 and plan[1] == 0


# -- what requests teach -------------------------------------------------------------


def test_a_new_request_starts_from_what_its_drafter_and_source_learned() -> None:
    scheduler = _scheduler()
    assert not scheduler.new_policy("mixed", "lookup").informed  # nothing learned yet
    scheduler.finished("mixed", {"lookup": _policy(0.95), "model": _policy(0.05)})
    lookup, model = scheduler.new_policy("mixed", "lookup"), scheduler.new_policy("mixed", "model")
    assert lookup.informed and model.informed
    assert lookup.acceptance.rates()[0] > 0.8 > 0.2 > model.acceptance.rates()[0]
    assert lookup.k > model.k
    fresh = AdaptiveSpeculation()
    assert not scheduler.new_policy("other", "lookup").informed  # another drafter's own
    assert scheduler.new_policy("mixed", "").acceptance.rates() == fresh.acceptance.rates()
    scheduler.finished(None, {"": _policy(0.95)})  # no drafter: nothing to learn
    assert not scheduler.new_policy(None, "").informed


def test_a_drafter_that_promised_more_than_it_kept_drafts_less_in_a_batch() -> None:
    """Rounds that drafted calibrate their drafter's source: one whose rates proved
    optimistic is planned with them scaled down, beside another with the same rates."""
    scheduler = _scheduler()
    scheduler.step_cost = _cost(0.060, 0.004)
    for _ in range(50):
        scheduler.drafted("ngram", "", 2.0, 0)  # promised two accepted drafts, got none
        scheduler.drafted("model", "", 2.0, 2)
    assert scheduler.prior("ngram", "").calibration == MIN_CALIBRATION
    assert scheduler.prior("model", "").calibration == 1.0
    assert scheduler.prior("ngram", "other source").calibration == 1.0
    plan = scheduler.plan([_drafting(0.6, "ngram") for _ in range(4)]
                          + [_drafting(0.6, "model") for _ in range(4)])
    assert sum(k or 0 for k in plan[4:]) > sum(k or 0 for k in plan[:4])
    unplanned = _scheduler(batch_planning=False)
    for _ in range(50):
        unplanned.drafted("ngram", "", 2.0, 0)  # rounds not batch planned: nothing kept
    assert unplanned.prior("ngram", "").calibration == 1.0
