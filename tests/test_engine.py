"""The engine: interleaving, cancellation, queue bound, timeouts, faults."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from decoding.drafter import DraftContext
from decoding.engine import Engine, EngineClosedError, QueueFullError, UnknownDrafterError
from decoding.prompting import encode_text
from decoding.round import decode
from decoding.sequence import ContextOverflowError
from decoding.types import FinishReason, GenerationRequest, SamplingParams, SpeculationParams
from drafters.ngram import NgramDrafter
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from tests.clocks import TickingClock

# a request that never ends must fail the test, not hang the suite
pytestmark = pytest.mark.timeout(240)

GREEDY = SamplingParams(temperature=0.0)


def _request(target: CausalLM, text: str, n: int = 24, **kw: object) -> GenerationRequest:
    ids = tuple(encode_text(target.tokenizer, text))
    return GenerationRequest(prompt_ids=ids, max_new_tokens=n, sampling=GREEDY, **kw)  # type: ignore[arg-type]


@pytest.fixture()
def engine(tiny_target: CausalLM) -> Iterator[Engine]:
    engine = Engine(tiny_target, {"ngram": NgramDrafter()}, default_drafter="ngram",
                    max_queue=4, max_active=2)
    engine.start()
    yield engine
    engine.shutdown()


def test_outputs_match_decoding_alone(engine: Engine, tiny_target: CausalLM) -> None:
    prompts = ["one two three one two", "Hello there", "x y z x y z x y", "The end"]
    streams = [engine.submit(_request(tiny_target, p)) for p in prompts]
    results = [[t for e in s for t in e.token_ids] for s in streams]
    for prompt, got in zip(prompts, results, strict=True):
        alone = [t for e in decode(tiny_target, None, _request(tiny_target, prompt))
                 for t in e.token_ids]
        assert got == alone, prompt


def test_concurrent_requests_interleave(tiny_target: CausalLM) -> None:
    """Both streams progress from the start, in the same forward passes: neither waits
    for the other to finish."""
    engine = Engine(tiny_target, max_active=2)
    streams = [engine.submit(_request(tiny_target, f"stream {i}", n=12,
                                      speculation=SpeculationParams(enabled=False)))
               for i in range(2)]
    engine.start()
    try:
        events = [list(stream) for stream in streams]
    finally:
        engine.shutdown()
    for stream_events in events:
        assert sum(len(e.token_ids) for e in stream_events) == 12
        decode_rounds = [e for e in stream_events if e.round_index > 0]
        assert len(decode_rounds) == 11
        assert all(e.batch_size == 2 for e in decode_rounds)
    assert engine.forward_passes == 12  # one prefill pass for both, then 11 shared rounds


class _HeldDrafter(NgramDrafter):
    """Prompt lookup that holds the model thread before its second decode round until
    let go: the request is surely still running (and holding its KV row) meanwhile.
    (Not the first: the prefill's event is handed over when that round's pass starts.)"""

    def __init__(self) -> None:
        super().__init__()
        self.rounds = 0
        self.holding = threading.Event()
        self.go = threading.Event()

    def source(self, state: Any, context: DraftContext) -> str:
        self.rounds += 1
        if self.rounds == 2:
            self.holding.set()
            assert self.go.wait(30), "never let go"
        return super().source(state, context)


def test_cancel_frees_the_slot_and_the_kv_rows(tiny_target: CausalLM) -> None:
    assert isinstance(tiny_target, BatchedLM)
    drafter = _HeldDrafter()
    engine = Engine(tiny_target, {"ngram": drafter}, default_drafter="ngram", max_active=2)
    engine.start()
    try:
        rows = tiny_target.rows_in_use
        stream = engine.submit(_request(tiny_target, "a b c", n=400))
        first = next(iter(stream))
        assert first.token_ids
        assert drafter.holding.wait(10)
        assert engine.num_running == 1
        assert tiny_target.rows_in_use == rows + 1  # the running sequence holds a KV row
        stream.cancel()
        drafter.go.set()
        deadline = time.monotonic() + 10
        while ((engine.num_running or tiny_target.rows_in_use != rows)
               and time.monotonic() < deadline):
            time.sleep(0.01)
        assert engine.num_running == 0 and engine.num_waiting == 0
        assert tiny_target.rows_in_use == rows  # its KV row is given back too
        other = engine.submit(_request(tiny_target, "still works", n=5))
        assert sum(len(e.token_ids) for e in other) == 5
    finally:
        drafter.go.set()
        engine.shutdown()


def test_queue_full_is_refused(tiny_target: CausalLM) -> None:
    engine = Engine(tiny_target, max_queue=2)  # not started: nothing leaves the queue
    engine.submit(_request(tiny_target, "a"))
    engine.submit(_request(tiny_target, "b"))
    with pytest.raises(QueueFullError):
        engine.submit(_request(tiny_target, "c"))
    engine.shutdown()


def test_unknown_drafter_and_overflow_are_refused(engine: Engine, tiny_target: CausalLM) -> None:
    with pytest.raises(UnknownDrafterError):
        engine.submit(_request(tiny_target, "a", speculation=SpeculationParams(drafter="nope")))
    too_long = GenerationRequest(prompt_ids=tuple([5] * tiny_target.max_context),
                                 max_new_tokens=1)
    with pytest.raises(ContextOverflowError):
        engine.submit(too_long)


def test_timeout_stops_the_work(tiny_target: CausalLM) -> None:
    """Regression: with the real clock, a fast machine filled the tiny model's context
    before 0.3 s and the request ended by ``length``."""
    engine = Engine(tiny_target, {"ngram": NgramDrafter()}, default_drafter="ngram",
                    clock=TickingClock(0.01))
    engine.start()
    try:
        stream = engine.submit(_request(tiny_target, "a b", n=100000, timeout_s=0.3))
        events = list(stream)
        assert events[-1].finish_reason is FinishReason.TIMEOUT
        # about two clock reads an iteration: the deadline passes within ~15 rounds
        assert 0 < events[-1].completion_tokens < tiny_target.max_context // 4
        assert engine.num_running == 0
    finally:
        engine.shutdown()


def test_shutdown_refuses_new_work(tiny_target: CausalLM) -> None:
    engine = Engine(tiny_target)
    engine.start()
    engine.shutdown()
    with pytest.raises(EngineClosedError):
        engine.submit(_request(tiny_target, "a"))


ASYNC_STREAMS_CEILING_S = 120.0  # 30 tokens of the tiny model: only a hang takes this long


async def test_async_consumption(engine: Engine, tiny_target: CausalLM) -> None:
    streams = [engine.submit(_request(tiny_target, f"async {i}", n=10)) for i in range(3)]

    async def collect(stream):  # type: ignore[no-untyped-def]
        return [t async for e in stream for t in e.token_ids]

    try:
        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)),
                                         ASYNC_STREAMS_CEILING_S)
    except TimeoutError:
        pytest.fail(f"three 10-token streams did not end within {ASYNC_STREAMS_CEILING_S} s")
    assert [len(r) for r in results] == [10, 10, 10]


def test_timeout_while_waiting_in_the_queue(tiny_target: CausalLM) -> None:
    engine = Engine(tiny_target, max_active=1, clock=TickingClock(0.01))
    engine.start()
    try:
        # the busy request holds the only slot for hundreds of iterations; the waiting
        # one's deadline passes after a few (the clock moves per read, not per second)
        busy = engine.submit(_request(tiny_target, "busy", n=450))
        waiting = engine.submit(_request(tiny_target, "waits", n=5, timeout_s=0.05))
        events = list(waiting)
        assert events[-1].finish_reason is FinishReason.TIMEOUT
        assert events[-1].completion_tokens == 0
        busy.cancel()
    finally:
        engine.shutdown()


def test_the_round_calls_starting_between_the_pass_s_preparation_and_its_run(
        tiny_target: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    from decoding.round import speculative_round
    from decoding.sequence import SequenceDecoder

    calls: list[str] = []
    prepare, run = tiny_target.prepare_pass, tiny_target.run_pass
    monkeypatch.setattr(tiny_target, "prepare_pass",
                        lambda items: calls.append("prepare") or prepare(items))
    monkeypatch.setattr(tiny_target, "run_pass",
                        lambda prepared: calls.append("run") or run(prepared))
    decoder = SequenceDecoder(tiny_target, None, _request(tiny_target, "a b c", n=3))
    try:
        speculative_round(tiny_target, [(decoder, 64)], [], starting=lambda: calls.append("start"))
        assert calls == ["prepare", "start", "run"]
        speculative_round(tiny_target, [], [(decoder, 0)])  # none given: nothing to call
        assert calls == ["prepare", "start", "run", "prepare", "run"]
    finally:
        decoder.close()


def test_events_leave_while_the_next_pass_runs(tiny_target: CausalLM,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A round's event reaches its stream while the next pass is prepared and about to
    run its long native call, not between passes where the event loop would hold up the
    model thread; the last ones leave when the engine has nothing more to run. Every
    event arrives, in order."""
    import threading

    from decoding.streams import RequestStream

    inside = threading.local()
    puts: list[tuple[bool, object]] = []
    prepare, run = tiny_target.prepare_pass, tiny_target.run_pass

    def prepare_pass(items: Any) -> Any:
        prepared = prepare(items)
        inside.flag = True  # prepared, not yet run
        return prepared

    def run_pass(prepared: Any) -> Any:
        inside.flag = False
        return run(prepared)

    put = RequestStream._put

    def recording_put(self: RequestStream, item: object) -> None:
        if threading.current_thread().name == "specserve-model":
            puts.append((getattr(inside, "flag", False), item))
        put(self, item)

    monkeypatch.setattr(tiny_target, "prepare_pass", prepare_pass)
    monkeypatch.setattr(tiny_target, "run_pass", run_pass)
    monkeypatch.setattr(RequestStream, "_put", recording_put)
    engine = Engine(tiny_target)
    engine.start()
    try:
        request = _request(tiny_target, "one two three", n=12,
                           speculation=SpeculationParams(enabled=False))
        events = list(engine.submit(request))
    finally:
        engine.shutdown()
    alone = [t for e in decode(tiny_target, None, request) for t in e.token_ids]
    assert [t for e in events for t in e.token_ids] == alone
    assert [item for _, item in puts][:-1] == events  # then END
    assert len(events) == 12
    # each event but the last leaves within the next round's pass
    assert [during for during, _ in puts] == [True] * 11 + [False, False]


IDLE_HAND_OVER_S = 5.0  # the stream's end after the engine goes idle: at once, with room


async def test_the_last_events_leave_when_the_engine_goes_idle(tiny_target: CausalLM) -> None:
    """No next pass will hand over the last round's events and the stream's end, so the
    engine hands them over when it has nothing more to run. Its own bounded wait: a
    stream left waiting fails here within seconds, not at the suite's timeout."""
    engine = Engine(tiny_target)
    engine.start()
    try:
        request = _request(tiny_target, "one two three", n=6,
                           speculation=SpeculationParams(enabled=False))
        stream = engine.submit(request)

        async def collect() -> list[Any]:
            return [event async for event in stream]

        task = asyncio.ensure_future(collect())
        deadline = time.monotonic() + 60
        while engine.num_running + engine.num_waiting and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert engine.num_running + engine.num_waiting == 0, "the request never finished"
        try:
            events = await asyncio.wait_for(task, IDLE_HAND_OVER_S)
        except TimeoutError:
            pytest.fail(f"the engine is idle and the stream has not ended after "
                        f"{IDLE_HAND_OVER_S} s: its last events were not handed over")
    finally:
        engine.shutdown()
    alone = [t for e in decode(tiny_target, None, request) for t in e.token_ids]
    assert [t for e in events for t in e.token_ids] == alone and len(alone) == 6
