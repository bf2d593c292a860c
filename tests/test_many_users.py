"""Many users on one model, through the engine and its KV blocks: requests without a bound
on their answer decode together under the default budget, a request preempted when the pool
runs dry gets exactly its text alone, and requests that share a long system prompt hold
its blocks once (read from the exported metric). On the default model, and on
Qwen2.5-Coder-1.5B where it is pulled (`specserve models pull qwen2.5-coder-1.5b`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from decoding.engine import Engine
from decoding.prompting import encode_chat
from decoding.round import decode
from decoding.streams import RequestStream
from decoding.types import GenerationRequest, RoundEvent, SamplingParams
from drafters.ngram import NgramDrafter
from gateway.service.settings import Settings
from observability.metrics import Metrics
from runtime.files import model_store
from runtime.loaders.loading import load_target
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import BLOCK, blocks_for

QWEN = model_store.QWEN_CODER_1_5B
GREEDY = SamplingParams(temperature=0.0)
TOPICS = ["sorting a list", "reading a file", "parsing JSON", "a binary search", "a stack",
          "a queue", "string reversal", "prime numbers", "a linked list", "recursion",
          "a hash map", "regular expressions", "a web request", "unit tests", "dates",
          "a command-line flag"]

# a stream that never ends must fail the test, not hang the suite
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module", params=["default", "qwen2.5-coder-1.5b"])
def target(request: pytest.FixtureRequest, default_target: CausalLM) -> Iterator[CausalLM]:
    if request.param == "default":
        yield default_target
        return
    if not QWEN.pulled():
        pytest.skip(f"needs `specserve models pull {QWEN.name}`")
    yield load_target(QWEN.name, quantize="auto")


def _chat(target: CausalLM, text: str, system: str | None = None) -> tuple[int, ...]:
    messages = [{"role": "user", "content": text}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return tuple(encode_chat(target.tokenizer, messages))


def _unbounded(target: CausalLM, prompt: tuple[int, ...], request_id: str) -> GenerationRequest:
    """A request without ``max_tokens``: its answer may run to the context's end."""
    return GenerationRequest(prompt_ids=prompt, max_new_tokens=target.max_context - len(prompt),
                             sampling=GREEDY, request_id=request_id)


def _take(stream: RequestStream, tokens: int) -> list[RoundEvent]:
    """A stream's events until it has ``tokens`` tokens or ends."""
    events: list[RoundEvent] = []
    for event in stream:
        events.append(event)
        if event.finished or sum(len(e.token_ids) for e in events) >= tokens:
            break
    return events


def _alone(target: CausalLM, request: GenerationRequest, tokens: int) -> list[int]:
    import dataclasses

    short = dataclasses.replace(request, max_new_tokens=tokens)
    return [t for event in decode(target, None, short) for t in event.token_ids]


def test_sixteen_requests_without_a_limit_decode_at_once(target: CausalLM) -> None:
    """Under the default KV budget, 16 requests that set no answer limit all run in one
    pass (none waits for another to end), and each stream's greedy tokens are its own
    alone."""
    settings = Settings()
    engine = Engine(target, {"ngram": NgramDrafter()}, default_drafter="ngram",
                    max_kv_bytes=settings.kv_cache_bytes, max_active=settings.max_active)
    engine.start()
    requests = [_unbounded(target, _chat(target, f"Explain {topic} in one line."), str(i))
                for i, topic in enumerate(TOPICS)]
    try:
        streams = [engine.submit(r) for r in requests]
        results = [_take(s, 8) for s in streams]
        running = engine.num_running
        for stream in streams:
            stream.cancel()
        for stream in streams:
            list(stream)
    finally:
        engine.shutdown()
    assert settings.max_active == 16 and running == 16
    assert max(e.batch_size for events in results for e in events) == 16
    assert target.kv_usage().used == 0  # every block back
    for request, events in zip(requests, results, strict=True):
        got = [t for e in events for t in e.token_ids][:8]
        assert got == _alone(target, request, 8)[: len(got)], request.request_id


def test_a_preempted_request_gets_its_text_alone(target: CausalLM) -> None:
    """A pool that holds one answer whole but not two: the newer request is preempted
    mid-answer, computed again from what it had, and its greedy text is its text alone;
    every block comes back."""
    prompts = [_chat(target, "Count from one to thirty in words."),
               _chat(target, "List the months of the year.")]
    tokens = 48
    need = max(blocks_for(len(p) + tokens + 2) for p in prompts)
    engine = Engine(target, {}, max_kv_bytes=(need + 2) * target.kv_block_bytes)
    engine.start()
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=tokens, sampling=GREEDY,
                                  request_id=str(i)) for i, p in enumerate(prompts)]
    try:
        results = [list(s) for s in [engine.submit(r) for r in requests]]
        preemptions = engine.preemptions
        counts = engine.kv_counts()
    finally:
        engine.shutdown()
    assert preemptions > 0
    assert counts["used"] == 0 and counts["free"] == need + 2
    for request, events in zip(requests, results, strict=True):
        assert [t for e in events for t in e.token_ids] == _alone(target, request, tokens)


def _system_prompt(target: CausalLM, tokens: int) -> str:
    lines: list[str] = []
    i = 0
    while len(target.tokenizer.encode(" ".join(lines))) < tokens:
        lines.append(f"Rule {i}: keep item {i * 7 % 13} apart from item {i * 5 % 11}.")
        i += 1
    return " ".join(lines)


def _gauges(metrics: Metrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def test_requests_sharing_a_system_prompt_hold_it_once(target: CausalLM) -> None:
    """8 requests that share a 2,000-token system prompt, all decoding: the KV in use, read
    from ``specserve_kv_blocks_used``, is at most one prefix plus 8 tails plus one block
    each (8 copies of the prefix would be 8 times more). (While the prompts are read, a
    prompt chunk computed beside the one that publishes the same blocks is held twice until
    its pass ends: the figure is read once every request has its first token.)"""
    system = _system_prompt(target, 2000)
    tokens = 24
    prompts = [_chat(target, f"Quote, one per line and in full, every rule that mentions item {i}.",
                     system) for i in range(8)]
    common = 0
    while all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    shared = common // BLOCK  # the full blocks all 8 prompts start with
    assert shared * BLOCK >= 1900
    tails = sum(blocks_for(len(p) + tokens + 2) - shared for p in prompts)
    bound = shared + tails + len(prompts)
    assert bound < 2 * shared  # without sharing, 8 prefixes would pass it by far

    # (no drafter: one token a round, so the first request is still decoding when the
    # last one's prompt is in)
    engine = Engine(target, {}, max_kv_bytes=Settings().kv_cache_bytes)
    metrics = Metrics()
    metrics.track_capacity(64, 16, Settings().kv_cache_bytes, engine.kv_counts)
    engine.start()
    seen: list[dict[str, float]] = []
    decoding, done = threading.Event(), threading.Event()

    def sample() -> None:  # the gauges as a scrape reads them, while all 8 decode
        decoding.wait()
        while not done.is_set():
            seen.append(_gauges(metrics))
            done.wait(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=tokens, sampling=GREEDY,
                                  request_id=str(i)) for i, p in enumerate(prompts)]
    try:
        streams = [engine.submit(r) for r in requests]
        firsts = [next(iter(s)) for s in streams]  # every prompt is in
        decoding.set()
        results = [[first, *s] for first, s in zip(firsts, streams, strict=True)]
    finally:
        decoding.set()
        done.set()
        sampler.join()
        engine.shutdown()
    most = max(s["specserve_kv_blocks_used"] for s in seen)
    assert max(s["specserve_kv_blocks_shared"] for s in seen) >= shared
    assert shared < most <= bound
    assert any(e.batch_size == 8 for events in results for e in events)  # together
    assert all(events[0].cached_tokens > 0 for events in results[1:])  # shared, not read
    assert _gauges(metrics)["specserve_kv_blocks_used"] == 0
    last = requests[-1]  # (a 2,000-token prompt alone takes a while on the 1.5B: one)
    assert [t for e in results[-1] for t in e.token_ids] == _alone(target, last, tokens)
