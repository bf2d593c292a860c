"""Admission under the KV budget, without a model: a target that only counts its blocks."""

from __future__ import annotations

from dataclasses import dataclass

from decoding.kv_budget import ADMISSION_MARGIN, KvBudget
from runtime.runner.passes import BLOCK, KVUsage


@dataclass
class PoolTarget:
    """Only what the budget reads of a target: the context and its pool of KV blocks."""

    max_context: int = 1000
    limit: int | None = 10
    used: int = 0
    kv_block_bytes: int = 160

    def kv_usage(self) -> KVUsage:
        return KVUsage(self.limit, self.used, 0)


def test_a_request_needs_its_prompt_s_blocks_and_a_margin_not_its_answer() -> None:
    budget = KvBudget(PoolTarget(), 1600)
    assert ADMISSION_MARGIN == 1
    assert budget.to_start(1) == 2
    assert budget.to_start(BLOCK) == 2
    assert budget.to_start(BLOCK + 1) == 3
    assert budget.to_start(5 * BLOCK) == 6


def test_the_free_blocks_are_the_pool_s_less_those_held() -> None:
    target = PoolTarget(used=3)
    budget = KvBudget(target, 1600)
    assert budget.free() == 7
    assert budget.limit == 10
    target.used = 10
    assert budget.free() == 0
    assert KvBudget(PoolTarget(limit=None), None).free() is None


def test_one_sequence_holds_at_most_the_whole_pool() -> None:
    assert KvBudget(PoolTarget(), 1600).positions() == 10 * BLOCK
    assert KvBudget(PoolTarget(limit=None), None).positions() is None
