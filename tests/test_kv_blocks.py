"""The KV pool in blocks on the tiny model: blocks taken as a sequence grows and given back
on a roll-back, a pool bound that refuses more, prompts shared by their published blocks
(and copied before a write), and every answer the same bits whatever blocks it lies in."""

from __future__ import annotations

import pytest
import torch

from runtime.runner.batched import BatchedLM
from runtime.runner.kv_blocks import KVPoolExhausted, chain_digests
from runtime.runner.passes import BLOCK, BatchItem, blocks_for


def _prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_a_sequence_takes_blocks_as_it_grows_and_gives_them_back(tiny_target: BatchedLM
                                                                  ) -> None:
    target = tiny_target
    state = target.new_state()
    target.prefill(state, _prompt(BLOCK + 3))
    assert len(state.blocks) == 2 and target.kv_usage().used == 2
    target.score(state, _prompt(BLOCK, 3000))  # into a third block
    assert len(state.blocks) == 3 and state.length == 2 * BLOCK + 3
    target.rollback(state, BLOCK)  # exactly one block's positions are kept
    assert len(state.blocks) == 1 and target.kv_usage().used == 1
    target.rollback(state, BLOCK - 1)
    assert len(state.blocks) == 1
    target.rollback(state, 0)
    assert state.blocks == [] and target.kv_usage().used == 0
    target.release(state)


def test_a_bounded_pool_refuses_more_blocks_and_takes_none(tiny_target: BatchedLM) -> None:
    target = tiny_target
    target.set_kv_budget(3 * target.kv_block_bytes)
    state, other = target.new_state(), target.new_state()
    try:
        target.prefill(state, _prompt(2 * BLOCK))
        assert target.kv_needed(other, BLOCK + 1) == 2
        with pytest.raises(KVPoolExhausted):
            target.prefill(other, _prompt(BLOCK + 1, 5000))
        assert target.kv_usage().used == 2 and target.kv_usage().limit == 3
        target.rollback(other, 0)
        target.prefill(other, _prompt(BLOCK, 5000))  # the one block left
        assert target.kv_usage().used == 3
    finally:
        target.release(state)
        target.release(other)
        target.set_kv_budget(None)


def test_a_prompt_shares_the_published_blocks_it_starts_with(tiny_target: BatchedLM) -> None:
    """A second sequence whose prompt starts with a published one's full blocks holds
    them (its last token and what differs computed), and its logits are those of computing
    everything; writing into a shared block copies it first; a block nobody holds any
    more is no longer found."""
    target = tiny_target
    common = _prompt(3 * BLOCK + 5)
    first, second, alone = target.new_state(), target.new_state(), target.new_state()
    target.prefill(first, common)
    target.publish_prefix(first, common)
    assert target.kv_usage().shared == 0
    own = [*common, 7, 8, 9]
    assert target.share_prefix(second, own) == 3 * BLOCK
    assert second.blocks == first.blocks[:3] and target.kv_usage().shared == 3
    shared_logits = target.score(second, own[3 * BLOCK:])
    expected = target.score(alone, own)
    assert torch.equal(shared_logits, expected[3 * BLOCK:])
    # a roll-back into a shared block, then a write: the sequence's own copy
    target.rollback(second, 2 * BLOCK + 4)
    target.score(second, [11])
    assert second.blocks[:2] == first.blocks[:2] and second.blocks[2] != first.blocks[2]
    assert target.kv_usage().shared == 2
    assert torch.equal(target.kv(first)[0][0], target.kv(alone)[0][0][:, :, : len(common)])
    for state in (first, second, alone):
        target.release(state)
    again = target.new_state()
    assert target.share_prefix(again, own) == 0  # freed: not found
    target.release(again)


def test_a_block_computed_twice_is_held_once(tiny_target: BatchedLM) -> None:
    """Two sequences that read the same prompt side by side: once both publish it, they
    hold one copy of its full blocks."""
    target = tiny_target
    prompt = _prompt(2 * BLOCK + 1, 7000)
    a, b = target.new_state(), target.new_state()
    target.forward_batch([BatchItem(a, prompt, 1), BatchItem(b, prompt, 1)])
    assert target.kv_usage().used == 6
    target.publish_prefix(a, prompt)
    target.publish_prefix(b, prompt)
    assert b.blocks[:2] == a.blocks[:2] and target.kv_usage().used == 4
    assert torch.equal(target.score(a, [5]), target.score(b, [5]))
    target.release(a)
    target.release(b)


def test_digests_chain_over_whole_blocks() -> None:
    tokens = _prompt(2 * BLOCK + 3)
    digests = chain_digests(tokens)
    assert len(digests) == 2 == blocks_for(len(tokens)) - 1
    assert chain_digests(tokens[:BLOCK]) == digests[:1]
    other = [tokens[0] + 1, *tokens[1:]]  # one token differs in the first block: both differ
    assert all(x != y for x, y in zip(chain_digests(other), digests, strict=True))
