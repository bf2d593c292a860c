"""Admission under the KV budget, without a model: a target that only sizes its KV."""

from __future__ import annotations

from dataclasses import dataclass

from decoding.kv_budget import KvBudget
from decoding.types import GenerationRequest


@dataclass
class SizedTarget:
    """Only what the budget reads of a target: the context and the KV sizes."""

    max_context: int = 100
    position_bytes: int = 10

    def kv_bytes(self, rows: int, positions: int) -> int:
        return rows * positions * self.position_bytes


def _request(prompt: int, max_new_tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(range(prompt)), max_new_tokens=max_new_tokens)


def test_a_request_needs_its_prompt_its_tokens_and_one_more() -> None:
    budget = KvBudget(SizedTarget(), 1000)
    assert budget.positions(_request(10, 20)) == 31
    assert budget.positions(_request(90, 50)) == 101  # no more than the context


def test_the_running_requests_hold_their_longest_each() -> None:
    budget = KvBudget(SizedTarget(), 1000)
    assert budget.reserved([]) == 0
    assert budget.reserved([31]) == 310
    assert budget.reserved([31, 11, 20]) == 3 * 31 * 10


def test_one_more_fits_while_the_budget_holds_it() -> None:
    budget = KvBudget(SizedTarget(), 1000)
    assert budget.room([], 500)  # one always fits when none runs
    assert budget.room([40], 50)  # 2 x 50 x 10 = 1000
    assert not budget.room([40], 51)
    assert not budget.room([40, 40], 40)  # 3 x 40 x 10 = 1200
    assert KvBudget(SizedTarget(), None).room([99] * 50, 99)
