"""The engine's batches: every sequence gets the output it would have had alone (greedy,
fp32), whatever the mix of prompts, drafts, sampling settings, finishes and cancellations."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from decoding.drafter import Drafter
from decoding.engine import Engine
from decoding.kv_budget import ADMISSION_MARGIN
from decoding.round import decode
from decoding.types import (
    FinishReason,
    GenerationRequest,
    RoundEvent,
    SamplingParams,
    SpeculationParams,
)
from drafters.model import ModelDrafter
from drafters.ngram import NgramDrafter
from runtime.runner.batched import BatchedLM, BatchedState
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import BLOCK, blocks_for
from tests.batching import (
    GREEDY,
    PROMPTS,
    _alone,
    _drafter_for,
    _engine,
    _greedy,
    _ids,
    _mixed_requests,
    _serve,
    _spy_on_draft_passes,
    _tokens,
)

# a request that never ends must fail the test, not hang the suite
pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("batch_planning", [True, False])
def test_every_sequence_in_a_batch_matches_decoding_it_alone(
    tiny_target: CausalLM, drafters: dict[str, Drafter], batch_planning: bool
) -> None:
    requests = _mixed_requests(tiny_target)
    engine = _engine(tiny_target, drafters, batch_planning=batch_planning)
    try:
        streams = [engine.submit(r) for r in requests]
        results = [list(s) for s in streams]
        passes = engine.forward_passes
    finally:
        engine.shutdown()
    rounds = 0
    for request, events in zip(requests, results, strict=True):
        alone = _alone(tiny_target, _drafter_for(request, drafters), request)
        assert _tokens(events) == alone, request.request_id
        assert events[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        rounds += len(events)
    assert passes < rounds / 2, "the streams did not share forward passes"
    assert tiny_target.rows_in_use == 0  # type: ignore[attr-defined]


def test_seeded_sampling_with_drafts_is_reproducible_in_a_batch(
    tiny_target: CausalLM, drafters: dict[str, Drafter]
) -> None:
    """Speculative sampling in a batch: the same seed and batch give the same text;
    every request completes its budget."""
    def run() -> list[list[int]]:
        requests = [GenerationRequest(
            prompt_ids=_ids(tiny_target, p), max_new_tokens=20, request_id=p,
            sampling=SamplingParams(temperature=1.0, seed=11 + i))
            for i, p in enumerate(PROMPTS[:4])]
        return [_tokens(events) for events in _serve(tiny_target, drafters, requests)]

    first = run()
    assert all(len(tokens) > 0 for tokens in first)
    assert run() == first


def test_a_request_cancelled_mid_batch_leaves_the_others_unchanged(
    tiny_target: CausalLM, drafters: dict[str, Drafter]
) -> None:
    requests = _greedy(tiny_target, PROMPTS[:4], 40)
    engine = _engine(tiny_target, drafters)
    try:
        streams = [engine.submit(r) for r in requests]
        collected: list[list[RoundEvent]] = [[] for _ in streams]

        def consume(i: int) -> None:
            for event in streams[i]:
                collected[i].append(event)
                if i == 1 and len(collected[i]) == 3:
                    streams[i].cancel()

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(streams))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads)
        # every slot is free once the streams ended, before shutdown could free them
        assert engine.num_running == 0
        assert tiny_target.rows_in_use == 0  # type: ignore[attr-defined]
    finally:
        engine.shutdown()
    assert sum(len(e.token_ids) for e in collected[1]) < 40
    for i, request in enumerate(requests):
        if i != 1:
            assert _tokens(collected[i]) == _alone(tiny_target, drafters["ngram"], request)


def test_a_long_prompt_is_prefilled_in_chunks_while_others_stream(
    tiny_target: CausalLM, drafters: dict[str, Drafter]
) -> None:
    long_request = GenerationRequest(prompt_ids=_ids(tiny_target, "count: " + "one two " * 60),
                                     max_new_tokens=8, sampling=GREEDY, request_id="long")
    short_request = GenerationRequest(prompt_ids=_ids(tiny_target, "Hello"), max_new_tokens=30,
                                      sampling=GREEDY, request_id="short",
                                      speculation=SpeculationParams(enabled=False))
    engine = _engine(tiny_target, drafters, prefill_chunk=16)
    try:
        short = engine.submit(short_request)
        long = engine.submit(long_request)
        short_events, long_events = list(short), list(long)
    finally:
        engine.shutdown()
    chunks = -(-len(long_request.prompt_ids) // 16)
    assert chunks > 5
    # the short stream kept getting tokens while the long prompt was being read
    assert len(short_events) >= chunks
    assert _tokens(long_events) == _alone(tiny_target, drafters["ngram"], long_request)
    assert _tokens(short_events) == _alone(tiny_target, None, short_request)


def test_a_failing_batch_fails_only_the_request_at_fault(
    tiny_target: CausalLM, drafters: dict[str, Drafter], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A model fault cannot be caused from outside: one is injected for one token.
    real = tiny_target.prepare_pass
    poisoned = 31337

    def prepare_pass(items):  # type: ignore[no-untyped-def]
        if any(poisoned in item.token_ids for item in items):
            raise RuntimeError("injected fault")
        return real(items)

    monkeypatch.setattr(tiny_target, "prepare_pass", prepare_pass)
    good = _greedy(tiny_target, PROMPTS[:3], 12)
    bad = GenerationRequest(prompt_ids=(1000, poisoned), max_new_tokens=12, sampling=GREEDY,
                            stop_token_ids=(), request_id="bad")
    engine = _engine(tiny_target, drafters)
    try:
        streams = [engine.submit(r) for r in good]
        bad_stream = engine.submit(bad)
        results = [list(s) for s in streams]
        bad_events = list(bad_stream)
    finally:
        engine.shutdown()
    monkeypatch.undo()
    assert bad_events[-1].finish_reason is FinishReason.ERROR
    assert bad_events[-1].error and "injected" not in bad_events[-1].error  # nothing leaks
    for request, events in zip(good, results, strict=True):
        assert _tokens(events) == _alone(tiny_target, drafters["ngram"], request)


def test_a_fault_in_the_engine_s_own_planning_ends_the_batch_not_the_engine(
    tiny_target: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault outside any request's own work (here the batch planner, injected: it cannot
    be caused from outside) ends the running requests with an error, frees their slots,
    and the engine serves the next request."""
    import decoding.scheduler as scheduler_module

    real = scheduler_module.plan_batch
    faults = iter([True])

    def plan_batch(*args, **kwargs):  # type: ignore[no-untyped-def]
        if next(faults, False):
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "plan_batch", plan_batch)
    engine = _engine(tiny_target, {"ngram": NgramDrafter()})
    try:
        streams = [engine.submit(r) for r in _greedy(tiny_target, PROMPTS[:2], 12)]
        ends = [list(stream)[-1] for stream in streams]
        assert engine.num_running == 0
        later = list(engine.submit(_greedy(tiny_target, PROMPTS[2:3], 12)[0]))
    finally:
        engine.shutdown()
    assert all(e.finish_reason is FinishReason.ERROR for e in ends)
    assert all(e.error and "injected" not in e.error for e in ends)  # nothing leaks
    assert later[-1].finish_reason is FinishReason.LENGTH
    assert len(_tokens(later)) == 12


@pytest.mark.parametrize("fail_batches", [False, True])
@pytest.mark.parametrize("native_chain", [True, False])
def test_a_draft_model_drafts_for_the_whole_batch_in_one_pass_per_step(
    tiny_target: CausalLM, tiny_target_dir: object, monkeypatch: pytest.MonkeyPatch,
    fail_batches: bool, native_chain: bool
) -> None:
    """Draft step i of every stream runs in one pass of the draft model (with the native
    chain, every step of every stream in one call); the outputs are what each stream gives
    alone. When such a pass fails, each stream drafts alone."""
    draft = BatchedLM.load(str(tiny_target_dir), dtype="float32")  # agrees with the target
    drafter = ModelDrafter(draft, tiny_target)
    drafter.native_chain = native_chain
    assert drafter.can_chain() == native_chain
    requests = _greedy(tiny_target, PROMPTS[:4], 24,
                       speculation=SpeculationParams(drafter="model"))
    sizes = _spy_on_draft_passes(draft, monkeypatch, fail_batches)
    results = _serve(tiny_target, {"ngram": NgramDrafter(), "model": drafter}, requests)
    monkeypatch.undo()
    assert max(sizes) > 1, "the streams' draft steps never shared a pass"
    if fail_batches:
        assert 1 in sizes, "after a failed shared pass each stream drafts alone"
    for request, events in zip(requests, results, strict=True):
        assert _tokens(events) == _alone(tiny_target, drafter, request), request.request_id
        assert sum(e.accepted_tokens for e in events) > 0
    assert draft.rows_in_use == 0
    assert tiny_target.rows_in_use == 0  # type: ignore[attr-defined]


def test_the_engine_calibrates_each_drafter_from_its_rounds(tiny_target: CausalLM,
                                                           tiny_target_dir: object) -> None:
    """Every batch-planned round that drafted adds what its policy promised and what was
    accepted to its drafter's calibration (the target drafting for itself: every draft
    is accepted, so its calibration is 1)."""
    itself = ModelDrafter(BatchedLM.load(str(tiny_target_dir), dtype="float32"), tiny_target)
    engine = _engine(tiny_target, {"self": itself}, default_drafter="self")
    accepted = 0
    try:
        streams = [engine.submit(GenerationRequest(
            prompt_ids=_ids(tiny_target, p), max_new_tokens=24, sampling=GREEDY))
            for p in PROMPTS[:4]]
        for stream in streams:
            accepted += sum(e.accepted_tokens for e in stream)
    finally:
        engine.shutdown()
    prior = engine.scheduler.prior("self", "")
    assert prior._expected > 0  # drafted rounds were recorded, with what they accepted
    assert accepted > 0  # (older rounds weigh less)
    assert 0 < prior._accepted <= accepted
    assert prior.calibration == 1.0


@pytest.fixture()
def fresh_engine(tiny_target: CausalLM) -> Iterator[Engine]:
    engine = _engine(tiny_target, {"ngram": NgramDrafter()})
    yield engine
    engine.shutdown()


def test_the_engine_learns_its_step_cost(fresh_engine: Engine, tiny_target: CausalLM) -> None:
    streams = [fresh_engine.submit(GenerationRequest(
        prompt_ids=_ids(tiny_target, p), max_new_tokens=16, sampling=GREEDY))
        for p in PROMPTS[:4]]
    for stream in streams:
        list(stream)
    fixed, per_token = fresh_engine.scheduler.step_cost.line()
    assert fixed > 0 and per_token >= 0


def test_requests_start_by_their_prompts_blocks_and_the_newest_is_preempted(
        tiny_target: BatchedLM) -> None:
    """A pool that holds one whole answer, not three: the three requests all start (each
    needs only its prompt's blocks and a margin), the newest running ones are preempted
    as the pool runs dry and computed again once there is room, and each request gets
    exactly the tokens it gets alone, greedy and seeded; at the end every block is back."""
    requests = [*_greedy(tiny_target, PROMPTS[:2], 60),
                GenerationRequest(prompt_ids=_ids(tiny_target, PROMPTS[2]), max_new_tokens=60,
                                  sampling=SamplingParams(temperature=0.9, seed=7),
                                  request_id="seeded")]
    need = max(blocks_for(len(r.prompt_ids) + r.max_new_tokens + 2) for r in requests)
    assert sum(blocks_for(len(r.prompt_ids)) + ADMISSION_MARGIN for r in requests) <= need + 2
    engine = _engine(tiny_target, {"ngram": NgramDrafter()},
                     max_kv_bytes=(need + 2) * tiny_target.kv_block_bytes)
    try:
        results = [list(s) for s in [engine.submit(r) for r in requests]]
        preemptions, counts = engine.preemptions, engine.kv_counts()
    finally:
        engine.shutdown()
    assert preemptions > 0
    assert counts["used"] == 0 and counts["free"] == need + 2
    for request, events in zip(requests, results, strict=True):
        assert _tokens(events) == _alone(tiny_target, NgramDrafter(), request), request.request_id
        assert events[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert any(e.batch_size == 3 for e in results[2])  # they ran together at first


def test_grammar_forced_tokens_are_counted_before_the_pass(
        tiny_target: BatchedLM, caplog: pytest.LogCaptureFixture) -> None:
    """A grammar that forces a long run of tokens adds them to a round's pass beyond its
    draft: the blocks they need are made room for (preempting another request), never a
    pass that fails for want of them. The forced request gets its text alone."""
    from grammars.guidance import GrammarCompiler

    compiler = GrammarCompiler(tiny_target.tokenizer, tiny_target.vocab_size)
    phrase = "the quick brown fox jumps over the lazy dog and runs far away, said the owl " * 2
    forced = GenerationRequest(prompt_ids=_ids(tiny_target, PROMPTS[1]), max_new_tokens=48,
                               sampling=GREEDY, request_id="forced",
                               grammar=compiler.json_schema({"const": phrase}))
    plain = _greedy(tiny_target, PROMPTS[:1], 30)[0]
    assert len(forced.prompt_ids) + len(plain.prompt_ids) < BLOCK + 2
    # each fits alone; a forced round (up to 32 tokens past the pending one) needs 2 more
    # blocks than a draft of k would
    budget = 4 * tiny_target.kv_block_bytes
    engine = _engine(tiny_target, {"ngram": NgramDrafter()}, max_kv_bytes=budget)
    try:
        with caplog.at_level(logging.WARNING, logger="decoding.round"):
            results = [list(s) for s in [engine.submit(plain), engine.submit(forced)]]
    finally:
        engine.shutdown()
    assert engine.preemptions > 0
    assert not [r for r in caplog.records if "failed" in r.getMessage()]  # no pass failed
    for request, events in zip([plain, forced], results, strict=True):
        assert events[-1].finish_reason is not FinishReason.ERROR, request.request_id
        assert _tokens(events) == _alone(tiny_target, NgramDrafter(), request), request.request_id


def test_a_round_s_pass_takes_no_more_tokens_than_the_engine_makes_room_for(
        tiny_target: BatchedLM) -> None:
    """``SequenceDecoder.pass_tokens(k)``, what the engine counts blocks by before a pass,
    bounds the pass a round then runs: a grammar's forced tokens come on top of the draft."""
    from decoding.round import step
    from decoding.sequence import SequenceDecoder
    from grammars.guidance import GrammarCompiler

    compiler = GrammarCompiler(tiny_target.tokenizer, tiny_target.vocab_size)
    phrase = "the quick brown fox jumps over the lazy dog and runs far away, said the owl " * 2
    for grammar in (compiler.json_schema({"const": phrase}), None):
        request = GenerationRequest(prompt_ids=_ids(tiny_target, PROMPTS[1]),
                                    max_new_tokens=48, sampling=GREEDY, grammar=grammar)
        decoder = SequenceDecoder(tiny_target, NgramDrafter(), request)
        try:
            step(decoder)  # the prompt and the first token
            for k in (0, 3):
                bound = decoder.pass_tokens(k)
                item = decoder.pass_item(decoder.propose(k))
                assert len(item.token_ids) <= bound
                if grammar is not None:
                    assert len(item.token_ids) > k + 2  # the forced run counts
        finally:
            decoder.close()


def test_a_request_alone_ends_where_the_pool_ends(tiny_target: BatchedLM) -> None:
    """A request the pool cannot hold to its end stops there with ``length``: its answer
    is plain decoding's, cut at the pool's last position."""
    request = _greedy(tiny_target, PROMPTS[:1], 80)[0]
    blocks = blocks_for(len(request.prompt_ids)) + 2
    events = _serve(tiny_target, {}, [request], max_kv_bytes=blocks * tiny_target.kv_block_bytes,
                    default_drafter=None)[0]
    alone = _alone(tiny_target, None, request)
    got = _tokens(events)
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert 0 < len(got) < len(alone) and got == alone[: len(got)]
    assert len(request.prompt_ids) + len(got) > (blocks - 1) * BLOCK


def test_the_pool_grows_as_answers_grow(tiny_long_target: BatchedLM) -> None:
    """Nothing is reserved for an answer's longest: a request that may give 900 tokens
    holds its prompt's blocks and its first token's; the pool shrinks back when idle."""
    long_request = GenerationRequest(prompt_ids=_ids(tiny_long_target, "word " * 700),
                                     max_new_tokens=4, sampling=GREEDY)
    engine = _engine(tiny_long_target, {"ngram": NgramDrafter()})
    try:
        first_size = tiny_long_target.kv_blocks.size
        list(engine.submit(long_request))
        assert tiny_long_target.kv_blocks.size == first_size  # shrank once it ended
        prompt = _ids(tiny_long_target, "hi")
        stream = engine.submit(GenerationRequest(prompt_ids=prompt, max_new_tokens=900,
                                                 sampling=GREEDY))
        first = next(iter(stream))
        assert first.token_ids
        assert engine.kv_counts()["used"] <= blocks_for(len(prompt) + 1 + 8)
        stream.cancel()
        list(stream)
    finally:
        engine.shutdown()


@pytest.mark.real_model
def test_streams_verifying_alternatives_together_match_each_alone(
        default_target: BatchedLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped draft's alternatives in a batch of streams (greedy, float32): each
    stream's output is its own plain decoding, and alternatives were taken on the way
    (alternatives run without batch invariance: ``BatchedLM.capabilities``)."""
    from wiring.drafts import load_model_drafter

    monkeypatch.setattr(default_target, "batch_invariant", False)
    from decoding.prompting import encode_chat

    drafter = load_model_drafter("default-draft", default_target, "float32", "float32")
    adopt = default_target.adopt_alternative
    taken: list[int] = []

    def counted(state: BatchedState, start: int, n: int) -> None:
        taken.append(n)
        adopt(state, start, n)

    monkeypatch.setattr(default_target, "adopt_alternative", counted)
    questions = ["Why is the sky blue?", "Give me three tips for a job interview.",
                 "Write a haiku about autumn rain.", "How do I boil an egg?"]
    requests = [GenerationRequest(
        prompt_ids=tuple(encode_chat(default_target.tokenizer, [{"role": "user", "content": q}])),
        max_new_tokens=48, sampling=GREEDY, request_id=q) for q in questions]
    results = _serve(default_target, {"model": drafter}, requests, default_drafter="model",
                     batch_planning=False)  # every stream drafts as if alone
    for request, events in zip(requests, results, strict=True):
        plain = _tokens(list(decode(default_target, None, request)))
        assert _tokens(events) == plain, request.request_id
    assert taken, "no alternative was taken"
    assert default_target.rows_in_use == 0
