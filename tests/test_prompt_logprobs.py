"""Prompt log-probabilities (``GenerationRequest.prompt_logprobs``): read from the
prefill's own pass, equal to a plain forward pass over the prompt, in one chunk or many,
alone or batched, never from the prefix cache; a request that does not ask keeps the
logits of one position only."""

from __future__ import annotations

import uuid

import pytest
import torch

from decoding.engine import Engine
from decoding.prefix_cache import InProcessStore, PrefixCache
from decoding.round import decode
from decoding.sequence import SequenceDecoder
from decoding.types import FinishReason, GenerationRequest, RoundEvent, SamplingParams
from runtime.runner.causal_lm import CausalLM

GREEDY = SamplingParams(temperature=0.0)
TOP = 3


def _prompt(target: CausalLM) -> tuple[int, ...]:
    text = "The quick brown fox jumps over the lazy dog. " * 3
    return tuple(target.tokenizer.encode(text))


def _reference(reference: CausalLM, prompt: tuple[int, ...]) -> torch.Tensor:  # [n - 1, V]
    """Each prompt token's row of log-probabilities, from transformers' own forward."""
    with torch.inference_mode():
        logits = reference.model(input_ids=torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def _check(event: RoundEvent, prompt: tuple[int, ...], expected: torch.Tensor) -> None:
    got = event.prompt_logprobs
    assert [lp.token_id for lp in got] == list(prompt[1:])
    values = torch.tensor([lp.logprob for lp in got])
    want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(values, want, atol=1e-4), (values - want).abs().max()
    for row, lp in zip(expected, got, strict=True):
        assert len(lp.top) == TOP
        top_values, _ = torch.topk(row, TOP)
        assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert row[lp.top[0][0]] == pytest.approx(float(top_values[0]), abs=1e-4)


def _request(prompt: tuple[int, ...], max_new: int = 3, **extra: object) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, sampling=GREEDY,
                             prompt_logprobs=True, logprobs=True, top_logprobs=TOP,
                             request_id=uuid.uuid4().hex, **extra)  # type: ignore[arg-type]


def test_prompt_logprobs_match_a_plain_forward(tiny_target: CausalLM,
                                               tiny_reference: CausalLM) -> None:
    prompt = _prompt(tiny_target)
    events = list(decode(tiny_target, None, _request(prompt)))
    _check(events[0], prompt, _reference(tiny_reference, prompt))
    assert all(not e.prompt_logprobs for e in events[1:])
    plain = list(decode(tiny_target, None, GenerationRequest(
        prompt_ids=prompt, max_new_tokens=3, sampling=GREEDY)))
    assert [e.token_ids for e in plain] == [e.token_ids for e in events]  # same answer
    assert not plain[0].prompt_logprobs


def test_no_tokens_generated_with_max_new_tokens_zero(tiny_target: CausalLM,
                                                      tiny_reference: CausalLM) -> None:
    prompt = _prompt(tiny_target)
    events = list(decode(tiny_target, None, _request(prompt, max_new=0)))
    assert len(events) == 1
    assert events[0].token_ids == () and events[0].logprobs == ()
    assert events[0].finish_reason is FinishReason.LENGTH
    assert events[0].completion_tokens == 0
    _check(events[0], prompt, _reference(tiny_reference, prompt))


def test_only_a_request_that_asks_keeps_every_prompt_row(tiny_target: CausalLM) -> None:
    prompt = _prompt(tiny_target)
    for asks, keeps in ((False, [0, 1]), (True, [7, len(prompt) - 7])):
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=2, sampling=GREEDY,
                                    prompt_logprobs=asks)
        decoder = SequenceDecoder(tiny_target, None, request)
        try:
            first = decoder.next_prompt_chunk(7)
            assert decoder.pass_item(first).keep == keeps[0]
            logits = tiny_target.forward_batch([decoder.pass_item(first)])[0]
            assert logits.shape[0] == keeps[0]
            assert decoder.prompt_done(first, logits, 0.0) is None
            rest = decoder.next_prompt_chunk()
            assert rest.final and decoder.pass_item(rest).keep == keeps[1]
        finally:
            decoder.close()


def _run(engine: Engine, requests: list[GenerationRequest]) -> list[list[RoundEvent]]:
    streams = [engine.submit(r) for r in requests]
    return [list(s) for s in streams]


@pytest.mark.parametrize("chunk", [5, 512])
def test_chunked_and_batched_prefill_give_the_same_values(
        tiny_target: CausalLM, tiny_reference: CausalLM, chunk: int) -> None:
    prompt = _prompt(tiny_target)
    other = tuple(tiny_target.tokenizer.encode("A different prompt, decoded alongside."))
    engine = Engine(tiny_target, prefill_chunk=chunk)
    engine.start()
    try:
        asked, plain, again = _run(engine, [
            _request(prompt), GenerationRequest(prompt_ids=other, max_new_tokens=8,
                                                sampling=GREEDY), _request(other)])
    finally:
        engine.shutdown()
    _check(asked[0], prompt, _reference(tiny_reference, prompt))
    _check(again[0], other, _reference(tiny_reference, other))
    assert not plain[0].prompt_logprobs


def test_a_request_for_prompt_logprobs_does_not_take_the_prefix_cache(
        tiny_target: CausalLM, tiny_reference: CausalLM) -> None:
    cache = PrefixCache(InProcessStore(), namespace=uuid.uuid4().hex, block_tokens=4)
    prompt = _prompt(tiny_target)
    plain = GenerationRequest(prompt_ids=prompt, max_new_tokens=2, sampling=GREEDY)
    list(decode(tiny_target, None, plain, prefix_cache=cache))  # stores the prompt's blocks
    again = list(decode(tiny_target, None, plain, prefix_cache=cache))
    assert again[0].cached_tokens > 0  # the cache holds the prompt
    asked = list(decode(tiny_target, None, _request(prompt), prefix_cache=cache))
    assert asked[0].cached_tokens == 0
    _check(asked[0], prompt, _reference(tiny_reference, prompt))
