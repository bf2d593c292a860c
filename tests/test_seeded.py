"""A seeded sampled request's text is plain decoding's with the same seed, whatever
drafts it: every drafter and combination, fixed or adaptive draft lengths, a warm
continuation cache, a prefix-cache hit, and an engine batch of concurrent requests."""

from __future__ import annotations

import uuid

import pytest

from decoding.drafter import Drafter
from decoding.engine import Engine
from decoding.policy import FixedSpeculation
from decoding.prefix_cache import InProcessStore, PrefixCache
from decoding.prompting import encode_text
from decoding.round import decode
from decoding.types import GenerationRequest, RoundEvent, SamplingParams, SpeculationParams
from drafters.combined import CombinedDrafter
from drafters.continuation import ContinuationDrafter
from drafters.model import ModelDrafter
from drafters.ngram import NgramDrafter
from runtime.runner.causal_lm import CausalLM

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "a b a b a b a b a b",
    "Hello",
]
SAMPLED = [
    SamplingParams(temperature=1.0, seed=5),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=6),
    SamplingParams(temperature=0.9, presence_penalty=0.6, frequency_penalty=0.3, seed=7),
]


def _ids(target: CausalLM, text: str) -> tuple[int, ...]:
    return tuple(encode_text(target.tokenizer, text))


def _tokens(events: list[RoundEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _request(ids: tuple[int, ...], params: SamplingParams, n: int = 32) -> GenerationRequest:
    return GenerationRequest(prompt_ids=ids, max_new_tokens=n, sampling=params)


def _plain(target: CausalLM, request: GenerationRequest) -> list[int]:
    return _tokens(list(decode(target, None, request)))


def _drafters(target: CausalLM, draft: CausalLM, cache: PrefixCache) -> dict[str, Drafter]:
    return {
        "ngram": NgramDrafter(),
        "ngram-unigram": NgramDrafter(max_ngram=3, min_ngram=1),
        "model-poor": ModelDrafter(draft, target),
        "model-self": ModelDrafter(target, target),
        "ngram+model-poor": CombinedDrafter([NgramDrafter()], ModelDrafter(draft, target)),
        "ngram+cache+model-self": CombinedDrafter(
            [NgramDrafter(), ContinuationDrafter(cache, target.vocab_size)],
            ModelDrafter(target, target)),
    }


def _cache() -> PrefixCache:
    return PrefixCache(InProcessStore(), namespace=f"seeded-{uuid.uuid4().hex}", block_tokens=8)


@pytest.mark.parametrize("params", SAMPLED, ids=["t1", "t0.7-top", "penalties"])
def test_every_drafter_gives_plain_decoding_s_text(
        tiny_target: CausalLM, tiny_draft: CausalLM, params: SamplingParams) -> None:
    cache = _cache()
    drafters = _drafters(tiny_target, tiny_draft, cache)
    for prompt in PROMPTS:
        request = _request(_ids(tiny_target, prompt), params)
        plain = _plain(tiny_target, request)
        assert len(plain) == 32
        for name, drafter in drafters.items():
            for policy in (FixedSpeculation(8), FixedSpeculation(3), None):
                events = list(decode(tiny_target, drafter, request, policy))
                assert _tokens(events) == plain, (name, prompt, policy)
        self_drafted = list(decode(tiny_target, drafters["model-self"], request,
                                   FixedSpeculation(8)))
        if not params.has_penalties:  # the draft's distribution is the target's: all kept
            assert sum(e.accepted_tokens for e in self_drafted) == sum(
                e.draft_tokens for e in self_drafted) > 0


def test_other_seeds_and_choices_give_other_text(tiny_target: CausalLM) -> None:
    ids = _ids(tiny_target, PROMPTS[2])
    base = SamplingParams(temperature=1.0, seed=5)
    texts = {tuple(_plain(tiny_target, _request(ids, p)))
             for p in (base, SamplingParams(temperature=1.0, seed=6),
                       SamplingParams(temperature=1.0, seed=5, choice=1))}
    assert len(texts) == 3
    unseeded = [_plain(tiny_target, _request(ids, SamplingParams(temperature=1.0)))
                for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # a seed drawn per request


def test_a_warm_continuation_cache_and_a_prefix_hit_change_nothing(
        tiny_target: CausalLM, tiny_draft: CausalLM) -> None:
    """The continuation cache proposes what an earlier request wrote (its own seed's
    text, or another's); a repeated prompt's KV comes from the prefix cache."""
    cache = _cache()
    drafter = CombinedDrafter([ContinuationDrafter(cache, tiny_target.vocab_size)],
                              ModelDrafter(tiny_draft, tiny_target))
    ids = _ids(tiny_target, PROMPTS[0])
    outputs: dict[int, list[int]] = {}
    for seed in (1, 1, 2, 1, 2, 3):
        request = _request(ids, SamplingParams(temperature=1.0, seed=seed))
        events = list(decode(tiny_target, drafter, request, prefix_cache=cache))
        assert _tokens(events) == _plain(tiny_target, request), seed
        outputs.setdefault(seed, _tokens(events))
    assert cache.stats.hits >= 5  # every request after the first reused the prompt's KV
    assert len({tuple(o) for o in outputs.values()}) == 3


def test_concurrent_requests_in_one_engine_batch(
        tiny_target: CausalLM, tiny_draft: CausalLM) -> None:
    cache = _cache()
    drafters = _drafters(tiny_target, tiny_draft, cache)
    requests = []
    for i, (prompt, params) in enumerate(
            [(p, s) for p in PROMPTS for s in SAMPLED]):
        drafter = list(drafters)[i % len(drafters)]
        requests.append(GenerationRequest(
            prompt_ids=_ids(tiny_target, prompt), max_new_tokens=24, sampling=params,
            request_id=str(i), speculation=SpeculationParams(drafter=drafter,
                                                             enabled=i % 4 != 3)))
    engine = Engine(tiny_target, drafters, default_drafter="ngram", prefix_cache=cache)
    engine.start()
    try:
        for _ in range(2):  # the second time with warm caches
            streams = [engine.submit(r) for r in requests]
            results = [list(s) for s in streams]
            for request, events in zip(requests, results, strict=True):
                assert _tokens(events) == _plain(tiny_target, request), request.request_id
            assert max(e.batch_size for events in results for e in events) > 1
    finally:
        engine.shutdown()
