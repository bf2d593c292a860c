"""Overload on a real ``specserve serve`` process with a small queue: a burst of
four times the queue's capacity gets quick 429s with ``Retry-After`` for the
excess, the admitted requests finish correctly, and the process's RSS returns
near its baseline afterwards."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import Measure
from tests.reliability.support import (
    MIB,
    TINY,
    RssSampler,
    ServeProcess,
    assert_openai_error,
    is_idle,
    mib,
    serve,
    settled_rss,
    sse_data,
    stream_text,
    wait_for,
)

# a request that never ends must fail the test, not hang the suite
pytestmark = pytest.mark.timeout(300)

MAX_QUEUE, MAX_ACTIVE = 4, 2
BURST = 4 * MAX_QUEUE
NEW_TOKENS = 48
PROMPT = "List the colours of the rainbow, one per line:"
RSS_SLACK = 48 * MIB  # allocator noise around the settled baseline


@dataclass(frozen=True)
class Outcome:
    status: int
    seconds: float
    ended: float  # time.monotonic() when the whole response was in
    text: str | None = None  # the completion, when admitted
    retry_after: str | None = None


def one_request(url: str, stream: bool, start: threading.Barrier) -> Outcome:
    payload = {"model": TINY, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
               "stream": stream}
    with httpx.Client(timeout=120) as http:
        start.wait()
        began = time.monotonic()
        response = http.post(f"{url}/v1/completions", json=payload)
        ended = time.monotonic()
    seconds = ended - began
    if response.status_code == 429:
        assert_openai_error(response, 429, "queue_full")
        return Outcome(429, seconds, ended, retry_after=response.headers.get("retry-after"))
    assert response.status_code == 200, response.text[:300]
    if stream:
        events = sse_data(response.text)
        assert events[-1] == "[DONE]", events[-2:]
        return Outcome(200, seconds, ended, stream_text(events)[0])
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == NEW_TOKENS
    return Outcome(200, seconds, ended, body["choices"][0]["text"])


def burst(url: str, size: int) -> list[Outcome]:
    """``size`` requests released at once, half of them streamed."""
    start = threading.Barrier(size)
    with ThreadPoolExecutor(max_workers=size) as pool:
        futures = [pool.submit(one_request, url, i % 2 == 1, start) for i in range(size)]
        return [f.result(timeout=300) for f in futures]


def reference_text(url: str) -> str:
    reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": TINY, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0})
    assert reply.status_code == 200
    return str(reply.json()["choices"][0]["text"])


def check_burst(outcomes: list[Outcome], expected: str) -> tuple[int, int]:
    admitted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    assert len(admitted) + len(refused) == len(outcomes)
    assert admitted, "nothing was admitted"
    assert len(refused) >= len(outcomes) // 2, f"only {len(refused)} of {len(outcomes)} refused"
    assert all(o.text == expected for o in admitted), "an admitted request came out wrong"
    assert all(o.retry_after is not None and int(o.retry_after) >= 1 for o in refused)
    # a 429 does not wait for the queue to drain: every refusal was in while admitted work
    # still ran, before the last answer, which waited for the queue ahead of it to go
    # through the model (an order, not a time: the CPU is shared, and a client thread of
    # a refused request may be scheduled after the first answer is out)
    last_answer = max(o.ended for o in admitted)
    late = [round(o.ended - last_answer, 3) for o in refused if o.ended >= last_answer]
    assert not late, f"{len(late)} refusals came after the last answer: {late} s after"
    return len(admitted), len(refused)


@pytest.fixture(scope="module")
def small_queue_server(tiny_target_dir: Path) -> Iterator[ServeProcess]:
    flags = ("--max-queue", str(MAX_QUEUE), "--max-active", str(MAX_ACTIVE),
             "--log-level", "warning")
    with serve(tiny_target_dir, *flags) as server:
        yield server


def run_bursts(server: ServeProcess, rounds: int, measure: Measure) -> None:
    startup = server.rss()
    expected = reference_text(server.url)
    check_burst(burst(server.url, BURST), expected)  # warm-up: allocator arenas, caches
    assert wait_for(lambda: is_idle(server.url), timeout=60)
    baseline = settled_rss(server)
    admitted = refused = 0
    with RssSampler(server.ps) as sampler:
        for _ in range(rounds):
            a, r = check_burst(burst(server.url, BURST), expected)
            admitted, refused = admitted + a, refused + r
            assert wait_for(lambda: is_idle(server.url), timeout=60), "work was left behind"
    settled = settled_rss(server)
    measure(bursts=rounds, burst_size=BURST, admitted=admitted, refused=refused,
            startup_rss=mib(startup), baseline_rss=mib(baseline),
            peak_rss=mib(sampler.peak), settled_rss=mib(settled))
    assert settled <= baseline + RSS_SLACK, (mib(baseline), mib(settled))


def test_burst_of_four_times_the_queue(small_queue_server: ServeProcess,
                                       measure: Measure) -> None:
    run_bursts(small_queue_server, rounds=1, measure=measure)


@pytest.mark.slow
def test_repeated_bursts_do_not_grow_memory(small_queue_server: ServeProcess,
                                            measure: Measure) -> None:
    run_bursts(small_queue_server, rounds=20, measure=measure)
