"""Batched speculation: many sequences in one forward pass give each the output it
would have had alone (greedy, fp32), whatever the mix of prompts, drafts, sampling
settings, finishes and cancellations in the batch."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest
import torch

from decoding import layout, weights
from decoding.batched import BatchedLM, BatchedState
from decoding.drafters import ModelDrafter, NgramDrafter
from decoding.drafters.base import Drafter
from decoding.drafters.combined import CombinedDrafter
from decoding.engine import Engine
from decoding.layout import attention_blocks
from decoding.policy import (
    MIN_CALIBRATION,
    AdaptiveSpeculation,
    SpeculationPrior,
    StepCost,
    plan_batch,
)
from decoding.prompting import encode_text
from decoding.sequence import decode
from decoding.target import BatchItem, CausalLM
from decoding.types import (
    FinishReason,
    GenerationRequest,
    RoundEvent,
    SamplingParams,
    SpeculationParams,
)

# a request that never ends must fail the test, not hang the suite
pytestmark = pytest.mark.timeout(240)

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Hello",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "a b a b a b a b a b a b",
    "Once upon a time " * 12,
    "x",
]


def _ids(target: CausalLM, text: str) -> tuple[int, ...]:
    return tuple(encode_text(target.tokenizer, text))


def _tokens(events: list[RoundEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _alone(target: CausalLM, drafter: Drafter | None, request: GenerationRequest) -> list[int]:
    return _tokens(list(decode(target, drafter, request)))


# -- the runner ---------------------------------------------------------------------


def test_batched_forward_matches_each_sequence_alone(tiny_target: BatchedLM) -> None:
    """Ragged rows (different cached lengths, different numbers of new tokens, prompt
    chunks among decoding rounds) in one pass give the logits each would get alone."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (3, 17, 40, 1, 9)]
    # short additions (decoding rounds) share one attention block; long ones (prompt
    # chunks riding along) get their own
    news = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (1, 40, 2, 9, 25)]
    alone = []
    for prompt, new in zip(prompts, news, strict=True):
        state = tiny_target.new_state()
        tiny_target.prefill(state, prompt)
        alone.append(tiny_target.score(state, new))
        tiny_target.release(state)
    states = [tiny_target.new_state() for _ in prompts]
    tiny_target.forward_batch([BatchItem(s, p, 1) for s, p in zip(states, prompts, strict=True)])
    got = tiny_target.forward_batch([BatchItem(s, n, len(n))
                                     for s, n in zip(states, news, strict=True)])
    for expected, logits, state, prompt, new in zip(alone, got, states, prompts, news,
                                                    strict=True):
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert state.length == len(prompt) + len(new)
    for state in states:
        tiny_target.release(state)


@pytest.mark.parametrize("news", [
    (1, 9, 1, 1, 1, 1),  # one stream verifying among one-token streams: a block apart
    (3, 1, 1, 3, 1, 5),  # a few short drafts spread over the rows: each alone
    (2, 2, 2, 2, 2, 2),  # every stream drafting alike: one block
    (1, 1, 4, 4, 4, 4),
])
@pytest.mark.parametrize("fold_single", [False, True])
def test_attention_blocks_give_the_model_s_own_logits(
        tiny_target: BatchedLM, news: tuple[int, ...], fold_single: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """However a decoding pass's rows are split into attention blocks, and with the query
    heads of a multi-token row (on a GPU, of every row) folded onto their shared
    key/value heads, each row gets the logits the model's own (transformers) forward
    pass gives it."""
    monkeypatch.setattr(tiny_target, "_fold_single", fold_single)
    rng = random.Random(len(news) + sum(news))
    reference = CausalLM(tiny_target.model, tiny_target.tokenizer)
    prompts = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (5, 30, 12, 60, 2, 21)]
    added = [[rng.randrange(1000, 20000) for _ in range(n)] for n in news]
    expected = []
    for prompt, new in zip(prompts, added, strict=True):
        state = reference.new_state()
        reference.prefill(state, prompt)
        expected.append(reference.score(state, new))
    states = [tiny_target.new_state() for _ in prompts]
    tiny_target.forward_batch([BatchItem(s, p, 1) for s, p in zip(states, prompts, strict=True)])
    items = [BatchItem(s, n, len(n)) for s, n in zip(states, added, strict=True)]
    got = tiny_target.forward_batch(items)
    for want, logits in zip(expected, got, strict=True):
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    for state in states:
        tiny_target.release(state)


def test_attention_blocks_keep_one_token_rows_apart_from_a_long_draft() -> None:
    """The layout is chosen by the padded (query, key) pairs it computes."""
    def items(news: list[int], length: int = 300) -> list[BatchItem]:
        return [BatchItem(BatchedState(row=i, length=length), [1] * n, n)
                for i, n in enumerate(news)]

    everyone = list(range(8))
    # 8 rows x 9 queries in one block would be 4x the work of 8 + 9 in two
    assert attention_blocks(items([9] + [1] * 7)) == [list(range(1, 8)), [0]]
    # one block when every row adds the same: splitting would only add calls
    assert attention_blocks(items([2] * 8)) == [everyone]
    assert attention_blocks(items([1] * 8)) == [everyone]
    # short drafts spread over the rows: over a long context each alone rather than one
    # 8 x 5 block; over a short one the extra calls cost more than the padding
    spread = [3, 1, 1, 3, 1, 1, 1, 5]
    assert attention_blocks(items(spread, 800)) == [[1, 2, 4, 5, 6], [0], [3], [7]]
    assert attention_blocks(items(spread, 300)) == [everyone]
    assert attention_blocks([]) == []


def test_prompts_joining_together_share_a_block_where_calls_cost_more() -> None:
    """Prompt chunks are attended each alone on a CPU, where a call is cheap next to the
    padding; with a GPU's per-call cost several prompts joining in one pass share one
    block. A prompt chunk never shares a block with decoding rounds."""
    def item(row: int, length: int, n: int) -> BatchItem:
        return BatchItem(BatchedState(row=row, length=length), [1] * n, 1)

    joining = [item(0, 200, 1), item(1, 150, 1), item(2, 0, 90), item(3, 0, 40),
               item(4, 0, 60)]
    assert attention_blocks(joining) == [[0, 1], [2], [3], [4]]
    assert attention_blocks(joining, overhead=250_000) == [[0, 1], [2, 3, 4]]
    # a long prompt chunk and a short one: padding the short one to 500 costs more
    uneven = [item(0, 0, 500), item(1, 0, 20)]
    assert attention_blocks(uneven, overhead=10_000) == [[0], [1]]


def test_prompts_sharing_a_block_get_the_model_s_own_logits(
        tiny_target: BatchedLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts of different lengths prefilled in one padded block, beside decoding rows,
    give each the logits of the model's own (transformers) forward."""
    monkeypatch.setattr(layout, "BLOCK_OVERHEAD", 10**9)  # as if calls were dear
    rng = random.Random(7)
    reference = CausalLM(tiny_target.model, tiny_target.tokenizer)
    running = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (14, 33)]
    joining = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (50, 17, 29)]
    step = [rng.randrange(1000, 20000) for _ in running]
    expected = []
    for prompt, token in zip(running, step, strict=True):
        state = reference.new_state()
        reference.prefill(state, prompt)
        expected.append(reference.score(state, [token]))
    for prompt in joining:
        expected.append(reference.score(reference.new_state(), prompt)[-1:])
    states = [tiny_target.new_state() for _ in running]
    tiny_target.forward_batch([BatchItem(s, p, 1) for s, p in zip(states, running, strict=True)])
    items = [BatchItem(s, [t], 1) for s, t in zip(states, step, strict=True)]
    fresh = [tiny_target.new_state() for _ in joining]
    items += [BatchItem(s, p, 1) for s, p in zip(fresh, joining, strict=True)]
    assert attention_blocks(items, overhead=10**9) == [[0, 1], [2, 3, 4]]
    got = tiny_target.forward_batch(items)
    for want, logits in zip(expected, got, strict=True):
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    for state in states + fresh:
        tiny_target.release(state)


def test_release_keeps_the_other_rows_intact(tiny_target: BatchedLM) -> None:
    """Freeing a row moves the last row into the gap; the moved sequence continues
    exactly as before."""
    ids = list(_ids(tiny_target, "one two three four five six seven"))
    first = tiny_target.new_state()
    middle = tiny_target.new_state()
    last = tiny_target.new_state()
    for state in (first, middle, last):
        tiny_target.prefill(state, ids)
    expected = tiny_target.score(last, [42])
    tiny_target.rollback(last, len(ids))
    tiny_target.release(middle)
    assert last.row == middle.row or last.row < 2
    torch.testing.assert_close(tiny_target.score(last, [42]), expected)
    tiny_target.release(first)
    tiny_target.release(last)
    tiny_target.release(last)  # idempotent
    assert tiny_target.rows_in_use == 0


def test_buffers_grow_past_their_first_size(tiny_target: BatchedLM) -> None:
    states = [tiny_target.new_state() for _ in range(9)]  # more rows than first allocated
    long_prompt = list(range(1000, 1000 + tiny_target.capacity + 30))
    tiny_target.prefill(states[0], long_prompt)  # more positions than first allocated
    assert tiny_target.capacity >= len(long_prompt)
    expected = tiny_target.score(states[0], [5])
    tiny_target.rollback(states[0], len(long_prompt))
    for state in states[1:]:
        tiny_target.release(state)  # the sequence still running keeps its cache
    torch.testing.assert_close(tiny_target.score(states[0], [5]), expected)
    tiny_target.release(states[0])
    assert tiny_target.capacity < len(long_prompt)  # idle: the buffers shrank back


def test_kv_round_trip(tiny_target: BatchedLM) -> None:
    ids = list(_ids(tiny_target, "prefix caching stores these keys and values"))
    state = tiny_target.new_state()
    tiny_target.prefill(state, ids)
    saved = [(k.clone(), v.clone()) for k, v in tiny_target.kv(state)]
    expected = tiny_target.score(state, [7])
    other = tiny_target.new_state()
    tiny_target.load_kv(other, saved)
    torch.testing.assert_close(tiny_target.score(other, [7]), expected)
    tiny_target.release(state)
    tiny_target.release(other)


# -- the engine ---------------------------------------------------------------------


def test_an_alternative_sees_only_what_precedes_the_token_it_stands_in_for(
        tiny_target: BatchedLM) -> None:
    """A row verifying drafts plus an alternative for its first draft, among other rows:
    the drafts' logits are those of the chain alone, the alternative's those it would
    get as the next token; once adopted, the cache continues as if it had been fed."""
    rng = random.Random(5)
    reference = CausalLM(tiny_target.model, tiny_target.tokenizer)
    prompts = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (7, 23, 3)]
    added = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (4, 1, 3)]
    alternative = [True, False, True]  # the last token of those rows is an alternative
    later = [rng.randrange(1000, 20000) for _ in range(3)]
    states = [tiny_target.new_state() for _ in prompts]
    tiny_target.forward_batch([BatchItem(s, p, 1) for s, p in zip(states, prompts, strict=True)])
    got = tiny_target.forward_batch([
        BatchItem(s, n, len(n), alternative=a)
        for s, n, a in zip(states, added, alternative, strict=True)])
    for state, prompt, new, alt, logits in zip(states, prompts, added, alternative, got,
                                              strict=True):
        chain = new[:-1] if alt else new
        ref = reference.new_state()
        reference.prefill(ref, prompt)
        torch.testing.assert_close(logits[: len(chain)], reference.score(ref, chain),
                                   rtol=1e-4, atol=1e-4)
        if not alt:
            continue
        ref = reference.new_state()
        reference.prefill(ref, prompt)
        expected = reference.score(ref, [new[0], new[-1]])
        torch.testing.assert_close(logits[-1], expected[-1], rtol=1e-4, atol=1e-4)
        tiny_target.adopt_alternative(state, len(prompt), len(new))
        assert state.length == len(prompt) + 2
        torch.testing.assert_close(tiny_target.score(state, later), reference.score(ref, later),
                                   rtol=1e-4, atol=1e-4)
    for state in states:
        tiny_target.release(state)
    plain = CausalLM(tiny_target.model, tiny_target.tokenizer)
    assert not plain.capabilities.branches
    with pytest.raises(ValueError, match="token trees"):
        plain.forward_batch([BatchItem(plain.new_state(), [1, 2, 3], 3, alternative=True)])


def _engine(target: CausalLM, drafters: dict[str, Drafter], **kw: object) -> Engine:
    kw.setdefault("default_drafter", "ngram")
    engine = Engine(target, drafters, max_active=16, max_queue=64,
                    **kw)  # type: ignore[arg-type]
    engine.start()
    return engine


def _serve(target: CausalLM, drafters: dict[str, Drafter], requests: list[GenerationRequest],
           **kw: object) -> list[list[RoundEvent]]:
    """Submit every request to a fresh engine at once; each one's events."""
    engine = _engine(target, drafters, **kw)
    try:
        streams = [engine.submit(r) for r in requests]
        return [list(s) for s in streams]
    finally:
        engine.shutdown()


def _greedy(target: CausalLM, prompts: list[str], max_new_tokens: int,
            **kw: object) -> list[GenerationRequest]:
    return [GenerationRequest(prompt_ids=_ids(target, p), max_new_tokens=max_new_tokens,
                              sampling=GREEDY, request_id=str(i), **kw)  # type: ignore[arg-type]
            for i, p in enumerate(prompts)]


@pytest.fixture()
def drafters(tiny_target: CausalLM, tiny_draft: CausalLM) -> dict[str, Drafter]:
    return {"ngram": NgramDrafter(), "model": ModelDrafter(tiny_draft, tiny_target),
            "ngram+model": CombinedDrafter([NgramDrafter()], ModelDrafter(tiny_draft, tiny_target))}


def _mixed_requests(target: CausalLM) -> list[GenerationRequest]:
    """Mixed prompt lengths, drafters, budgets (some finish while others run) and
    sampling settings."""
    requests = []
    for i, prompt in enumerate(PROMPTS):
        requests.append(GenerationRequest(
            prompt_ids=_ids(target, prompt), max_new_tokens=(5, 40, 17, 33, 9, 26)[i],
            sampling=GREEDY, request_id=f"greedy-{i}",
            speculation=SpeculationParams(drafter=("ngram", "model", "ngram+model", None)[i % 4],
                                          enabled=i != 5)))
    requests.append(GenerationRequest(
        prompt_ids=_ids(target, PROMPTS[0]), max_new_tokens=30, request_id="penalties",
        sampling=SamplingParams(temperature=0.0, presence_penalty=0.8, frequency_penalty=0.5)))
    requests.append(GenerationRequest(  # seeded sampling, plain: the same draws as alone
        prompt_ids=_ids(target, PROMPTS[2]), max_new_tokens=24, request_id="sampled",
        sampling=SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7),
        speculation=SpeculationParams(enabled=False)))
    return requests


def _drafter_for(request: GenerationRequest, drafters: dict[str, Drafter]) -> Drafter | None:
    if not request.speculation.enabled:
        return None
    return drafters[request.speculation.drafter or "ngram"]


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
    real = tiny_target.forward_batch
    poisoned = 31337

    def forward_batch(items):  # type: ignore[no-untyped-def]
        if any(poisoned in item.token_ids for item in items):
            raise RuntimeError("injected fault")
        return real(items)

    monkeypatch.setattr(tiny_target, "forward_batch", forward_batch)
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


def _spy_on_draft_passes(model: BatchedLM, monkeypatch: pytest.MonkeyPatch,
                         fail_batches: bool = False) -> list[int]:
    """The sizes of the draft model's forward passes (optionally failing every pass of
    more than one sequence: a fault that cannot be caused from outside)."""
    sizes: list[int] = []
    real = model.forward_batch

    def forward_batch(items):  # type: ignore[no-untyped-def]
        sizes.append(len(items))
        if fail_batches and len(items) > 1:
            raise RuntimeError("injected draft fault")
        return real(items)

    monkeypatch.setattr(model, "forward_batch", forward_batch)
    return sizes


def test_a_fault_in_the_engine_s_own_planning_ends_the_batch_not_the_engine(
    tiny_target: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault outside any request's own work (here the batch planner, injected: it cannot
    be caused from outside) ends the running requests with an error, frees their slots,
    and the engine serves the next request."""
    import decoding.engine as engine_module

    real = engine_module.plan_batch
    faults = iter([True])

    def plan_batch(*args, **kwargs):  # type: ignore[no-untyped-def]
        if next(faults, False):
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "plan_batch", plan_batch)
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
def test_a_draft_model_drafts_for_the_whole_batch_in_one_pass_per_step(
    tiny_target: CausalLM, tiny_target_dir: object, monkeypatch: pytest.MonkeyPatch,
    fail_batches: bool
) -> None:
    """Draft step i of every stream runs in one pass of the draft model; the outputs are
    what each stream gives alone. When such a pass fails, each stream drafts alone."""
    draft = BatchedLM.load(str(tiny_target_dir), dtype="float32")  # agrees with the target
    drafter = ModelDrafter(draft, tiny_target)
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


# -- choosing draft lengths for a batch ------------------------------------------------


def _policy(rate: float) -> AdaptiveSpeculation:
    """A policy that has seen every draft token kept with chance ``rate``."""
    policy = AdaptiveSpeculation()
    rng = random.Random(0)
    for _ in range(200):
        accepted = 0
        while accepted < 4 and rng.random() < rate:
            accepted += 1
        policy.update(4, accepted)
    return policy


def _cost(fixed: float, per_token: float) -> StepCost:
    cost = StepCost()
    for tokens in (1, 4, 9, 16, 40, 80, 2, 30):
        cost.observe(tokens, fixed + per_token * tokens)
    return cost


def test_step_cost_recovers_a_line() -> None:
    cost = StepCost()
    for tokens in (1, 4, 9, 16, 40, 80, 2, 30) * 4:  # the prior line fades as passes come
        cost.observe(tokens, 0.05 + 0.004 * tokens)
    fixed, per_token = cost.line()
    assert fixed == pytest.approx(0.05, rel=0.05)
    assert per_token == pytest.approx(0.004, rel=0.05)


def test_speculation_shrinks_as_the_batch_grows() -> None:
    cost = _cost(0.060, 0.004)  # a draft token costs 1/15 of a step: a CPU-like target
    good = [_policy(0.9)]
    assert sum(plan_batch(good, [100], cost)) >= 4  # one stream: draft long
    totals = [sum(plan_batch([_policy(0.5) for _ in range(n)], [100] * n, cost)) / n
              for n in (1, 4, 16, 64)]
    assert totals[0] > totals[-1]
    assert totals == sorted(totals, reverse=True)
    assert plan_batch([_policy(0.5) for _ in range(64)], [100] * 64, cost) == [0] * 64


def test_a_drafter_that_proved_optimistic_drafts_less_in_a_batch() -> None:
    """The same rates, scaled by how far they have proven optimistic: fewer drafts, and
    none once the batch is better off decoding plainly; one stream alone keeps its own
    rates."""
    cost = _cost(0.060, 0.004)
    policies = [_policy(0.6) for _ in range(4)]
    trusted = sum(plan_batch(policies, [100] * 4, cost))
    halved = sum(plan_batch(policies, [100] * 4, cost, calibration=[0.5] * 4))
    assert trusted > halved
    assert plan_batch(policies, [100] * 4, cost, calibration=[0.25] * 4) == [0] * 4
    alone = plan_batch(policies[:1], [100], cost)
    assert plan_batch(policies[:1], [100], cost, calibration=[0.25]) == alone


def test_calibration_is_accepted_over_promised_drafts() -> None:
    prior = SpeculationPrior()
    assert prior.calibration == 1.0  # nothing promised yet
    prior.record(1.0, 0)
    assert prior.calibration == 1.0  # too little to go by
    for _ in range(20):
        prior.record(1.5, 1)
    assert prior.calibration == pytest.approx(1 / 1.5, rel=0.05)
    for _ in range(300):
        prior.record(2.0, 0)  # promised much, accepted nothing: floored
    assert prior.calibration == MIN_CALIBRATION
    for _ in range(300):
        prior.record(1.0, 3)  # better than promised: the rates are used as they are
    assert prior.calibration == 1.0


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
    prior = engine._prior("self", "")
    assert prior._expected > 0  # drafted rounds were recorded, with what they accepted
    assert accepted > 0  # (older rounds weigh less)
    assert 0 < prior._accepted <= accepted
    assert prior.calibration == 1.0


def test_plan_batch_respects_limits_and_missing_drafters() -> None:
    cost = _cost(0.060, 0.001)
    ks = plan_batch([_policy(0.95), None, _policy(0.95)], [2, 50, 0], cost)
    assert ks[0] <= 2 and ks[1] == 0 and ks[2] == 0


def test_a_backed_off_sequence_probes_again() -> None:
    cost = _cost(0.060, 0.050)  # verifying is as dear as decoding: never speculate
    policy = _policy(0.2)
    seen = []
    for _ in range(40):
        k = plan_batch([policy], [100], cost)[0]
        seen.append(k)
        policy.update(k, 0)
    assert 0 < sum(seen) <= 3


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
    fixed, per_token = fresh_engine.step_cost.line()
    assert fixed > 0 and per_token >= 0


@pytest.mark.gpu
def test_batched_greedy_on_cuda_matches_each_sequence_alone(tiny_target_dir: object) -> None:
    """The same identity on a GPU, float32: several streams sharing forward passes in the
    engine produce what each produces alone."""
    target = BatchedLM.load(str(tiny_target_dir), dtype="float32", device="cuda")
    assert target.capabilities.batched
    requests = _greedy(target, PROMPTS, 24)
    results = _serve(target, {"ngram": NgramDrafter()}, requests)
    for request, events in zip(requests, results, strict=True):
        assert _tokens(events) == _alone(target, NgramDrafter(), request)


def test_one_stream_weighs_whole_drafts_past_the_one_token_jump() -> None:
    """On a CPU a one-token pass is much cheaper than a two-token one, while each
    further token costs little: one stream drafts several tokens when they are likely
    kept (one token alone would not pay), and none when they are not."""
    cost = StepCost()
    for _ in range(5):
        for tokens in (2, 3, 5, 9):
            cost.observe(tokens, 0.060 + 0.002 * tokens)
        cost.observe(1, 0.045)
    assert cost.predict(1) == pytest.approx(0.045)
    assert cost.predict(5) == pytest.approx(0.070, rel=0.05)
    assert plan_batch([_policy(0.8)], [100], cost)[0] >= 3
    assert plan_batch([_policy(0.2)], [100], cost) == [0]


def test_admission_waits_for_kv_room(tiny_target: BatchedLM) -> None:
    """With a KV budget for one request at a time, a second waits for the first to end
    (rather than growing the cache past the budget), then completes unchanged."""
    requests = _greedy(tiny_target, PROMPTS[:2], 16)
    positions = max(len(r.prompt_ids) + r.max_new_tokens + 1 for r in requests)
    one = tiny_target.kv_bytes(1, positions)
    assert tiny_target.kv_bytes(2, positions) == one  # both fit the first rows...
    budget = one - 1  # ...so the budget is set just under them
    results = _serve(tiny_target, {"ngram": NgramDrafter()}, requests, max_kv_bytes=budget)
    for request, events in zip(requests, results, strict=True):
        assert _tokens(events) == _alone(tiny_target, NgramDrafter(), request)
        assert all(e.batch_size == 1 for e in events)  # never ran together
    together = _serve(tiny_target, {"ngram": NgramDrafter()}, requests, max_kv_bytes=2 * one)
    assert any(e.batch_size == 2 for e in together[0])


def test_the_cache_is_sized_for_the_running_requests(tiny_target: BatchedLM) -> None:
    long_request = GenerationRequest(prompt_ids=_ids(tiny_target, "word " * 300),
                                     max_new_tokens=4, sampling=GREEDY)
    engine = _engine(tiny_target, {"ngram": NgramDrafter()})
    try:
        list(engine.submit(long_request))
        assert tiny_target.capacity < len(long_request.prompt_ids)  # shrank once it ended
        stream = engine.submit(GenerationRequest(prompt_ids=_ids(tiny_target, "hi"),
                                                 max_new_tokens=400, sampling=GREEDY))
        first = next(iter(stream))
        assert first.token_ids
        assert tiny_target.capacity > 400  # reserved for the whole request up front
        stream.cancel()
        list(stream)
    finally:
        engine.shutdown()


@pytest.mark.real_model
def test_streams_verifying_alternatives_together_match_each_alone(
        default_target: BatchedLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped draft's alternatives in a batch of streams (greedy, float32): each
    stream's output is its own plain decoding, and alternatives were taken on the way."""
    from decoding.factory import load_model_drafter
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False])
def test_weight_products_match_the_plain_product_on_every_path(
        dtype: torch.dtype, packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed for oneDNN (a CPU that has it) or not, for a step, a verify pass, a batch and a
    prefill chunk, with and without a bias: the plain ``x @ w.T + b``, to rounding."""
    if packed and dtype not in weights.onednn_dtypes():
        pytest.skip(f"this PyTorch build's oneDNN does not pack {dtype}")
    if not packed:
        monkeypatch.setattr(weights, "onednn_dtypes", frozenset)
    torch.manual_seed(0)
    rows = torch.randn(96, 64).to(dtype)
    bias = torch.randn(96).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for b in (None, bias):
        matrix = weights.Matrix(rows, b)
        assert (matrix.packed is not None) == packed
        for tokens in (1, 2, 5, weights.ONEDNN_MAX_TOKENS, weights.ONEDNN_MAX_TOKENS + 8):
            x = torch.randn(tokens, 64).to(dtype)
            want = x.float() @ rows.float().t() + (0 if b is None else b.float())
            got = matrix(x)
            assert got.dtype == dtype and got.shape == (tokens, 96)
            torch.testing.assert_close(got.float(), want, atol=tolerance * 8, rtol=tolerance)
