"""Clients that leave at random points, against a real ``specserve serve``
process: before the response, right after its headers, after some events, or
while waiting for a whole response. Afterwards nothing is left running or
waiting (``/ready`` and the metrics port agree), streams that stayed to the end
came out exactly right, and crowd after crowd leaves the process's RSS where the idle
server had it."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from decoding.engine import Engine
from gateway.server import create_app
from tests.gateway.conftest import in_process, tiny_settings
from tests.reliability.conftest import Measure
from tests.reliability.support import (
    MIB,
    TINY,
    RssSampler,
    ServeProcess,
    is_idle,
    mib,
    scrape,
    serve,
    settled_rss,
    sse_data,
    stream_text,
    wait_for,
)

# a request that never ends must fail the test, not hang the suite
pytestmark = pytest.mark.timeout(300)

LONG = 200  # tokens a leaving client asks for: it is always gone before the end
KEPT = 24  # tokens of a stream that stays
CONCURRENCY = 24  # leaving clients at once (below the default queue of 64)
KEEPERS = 6
PROMPT = "Write a long story about a lighthouse keeper and the sea."
KEEPER_PROMPT = "Count from one to twenty in words:"
WAYS = ("before_headers", "after_headers", "after_events", "whole_response")
IDLE_WITHIN_S = 60.0  # a ceiling only a hang reaches
RSS_SLACK = 48 * MIB
CROWDS = 5  # crowds in a row; each must leave RSS near the idle server's


def payload(prompt: str, max_tokens: int, stream: bool) -> dict[str, object]:
    return {"model": TINY, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


async def leave(url: str, way: str, rng: random.Random) -> bool:
    """One client that goes away; returns whether it saw any of the response."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        if way == "before_headers":
            request = http.post("/v1/chat/completions", json=payload(PROMPT, LONG, True))
            try:
                await asyncio.wait_for(request, timeout=rng.uniform(0.0, 0.05))
            except TimeoutError:
                return False
            return True
        if way == "whole_response":
            request = http.post("/v1/chat/completions", json=payload(PROMPT, LONG, False))
            try:
                await asyncio.wait_for(request, timeout=rng.uniform(0.05, 0.5))
            except TimeoutError:
                return False
            return True
        events = 0 if way == "after_headers" else rng.randint(1, 20)
        async with http.stream("POST", "/v1/chat/completions",
                               json=payload(PROMPT, LONG, True)) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                if seen >= events:
                    break
                seen += line.startswith("data: ")
    return True  # leaving the blocks closed the connection mid-stream


async def keep(url: str) -> str:
    """A stream that stays to the end; returns its text."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        response = await http.post("/v1/chat/completions",
                                   json=payload(KEEPER_PROMPT, KEPT, True))
    events = sse_data(response.text)
    assert events[-1] == "[DONE]", events[-2:]
    return stream_text(events)[0]


async def crowd(url: str, clients: int, seed: int) -> tuple[list[str], Counter[str]]:
    rng = random.Random(seed)
    ways = Counter(rng.choice(WAYS) for _ in range(clients))
    plan = [way for way, count in ways.items() for _ in range(count)]
    rng.shuffle(plan)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(way: str) -> None:
        async with gate:
            await leave(url, way, random.Random(rng.random()))

    keepers = [asyncio.create_task(keep(url)) for _ in range(KEEPERS)]
    await asyncio.gather(*(one(way) for way in plan))
    return list(await asyncio.gather(*keepers)), ways


def reference(url: str) -> str:
    response = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                          json=payload(KEEPER_PROMPT, KEPT, False))
    assert response.status_code == 200
    return str(response.json()["choices"][0]["message"]["content"])


def samples(server: ServeProcess, name: str) -> list[dict[str, str]]:
    text = httpx.get(f"{server.metrics_url}/metrics", timeout=10).text
    return [sample.labels for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name]


def occupancy(server: ServeProcess) -> tuple[float, float]:
    samples = scrape(server.metrics_url)
    return (samples["specserve_num_requests_running"],
            samples["specserve_num_requests_waiting"])


@contextmanager
def serve_for_crowds(model_dir: Path) -> Iterator[ServeProcess]:
    with serve(model_dir, "--max-tokens", str(LONG), "--log-level", "warning") as s:
        yield s


@pytest.fixture(scope="module")
def server(tiny_target_dir: Path) -> Iterator[ServeProcess]:
    with serve_for_crowds(tiny_target_dir) as s:
        yield s


def crowd_once(server: ServeProcess, clients: int, seed: int, expected: str
               ) -> tuple[int, int, float, Counter[str]]:
    """One crowd; nothing left running or waiting after it, the kept streams right. Its
    settled RSS, peak RSS, seconds to idle and the ways its clients left."""
    with RssSampler(server.ps) as sampler:
        kept, ways = asyncio.run(crowd(server.url, clients, seed))
        left_at = time.monotonic()
        assert wait_for(lambda: is_idle(server.url), timeout=IDLE_WITHIN_S), \
            httpx.get(f"{server.url}/ready").json()
        idle_after = time.monotonic() - left_at
    assert occupancy(server) == (0.0, 0.0)
    assert kept == [expected] * KEEPERS, "a stream that stayed came out wrong"
    return settled_rss(server), sampler.peak, idle_after, ways


def run_crowd(server: ServeProcess, clients: int, seed: int, measure: Measure,
              crowds: int = CROWDS) -> None:
    """Crowd after crowd, each leaving the server's RSS within allocator noise of the idle
    server's: what a client leaves behind would add up crowd after crowd. Measured crowd by
    crowd (python -m tests.reliability.crowds, docs/reliability.md), settled RSS stays
    within about 20 MiB of idle, quiet or beside two busy loops; before the server mapped
    its large allocations apart it rose in steps of 20-40 MiB to +120 MiB and stayed."""
    expected = reference(server.url)
    idle = settled_rss(server)
    settled, peaks = [], []
    for i in range(crowds):
        rss, peak, idle_after, ways = crowd_once(server, clients, seed + i, expected)
        settled.append(rss)
        peaks.append(peak)
    measure(clients=clients, crowds=crowds, ways=dict(ways), kept_streams=KEEPERS,
            idle_after_s=round(idle_after, 2), idle_rss=mib(idle),
            settled_rss=[mib(r) for r in settled], peak_rss=mib(max(peaks)))
    assert max(settled) <= idle + RSS_SLACK, (mib(idle), [mib(r) for r in settled])
    assert server.process.poll() is None
    server.assert_clean_log()


def test_client_gone_while_sending_its_body_is_not_a_server_error(
        server: ServeProcess) -> None:
    """Regression: a client that left mid-body was logged as an unhandled error
    (a traceback) and counted as a 500; a client that left is now counted as
    ``client_closed``, not as an invalid request."""
    body = json.dumps(payload(PROMPT, 4, False)).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(5):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head.encode() + body[: len(body) // 2])
            time.sleep(0.05)

    def statuses() -> set[str]:
        return {labels["status"] for labels in samples(server, "specserve_requests_total")}

    assert wait_for(lambda: "499" in statuses(), timeout=10), statuses()
    assert "500" not in statuses()
    kinds = {labels["type"] for labels in samples(server, "specserve_request_errors_total")}
    assert kinds == {"client_closed", "unavailable"}, kinds  # 503s: /ready while loading
    server.assert_clean_log()


def test_hundred_clients_leave_mid_stream(server: ServeProcess, measure: Measure) -> None:
    run_crowd(server, clients=100, seed=7, measure=measure)


@pytest.mark.slow
def test_many_clients_leave_mid_stream(server: ServeProcess, measure: Measure) -> None:
    run_crowd(server, clients=1000, seed=11, measure=measure, crowds=2)


async def test_slot_is_free_once_the_client_sees_the_end(tiny_engine: Engine) -> None:
    """A finished request must not be counted as running (``/ready``, the
    ``num_requests_running`` gauge) once its client has the whole response."""
    still_running = 0
    async with in_process(create_app(tiny_settings(), engine=tiny_engine)) as client:
        for i in range(30):
            response = await client.post("/v1/completions", json={
                "model": TINY, "prompt": f"Item {i}", "max_tokens": 3, "stream": True})
            assert sse_data(response.text)[-1] == "[DONE]"
            still_running += tiny_engine.num_running > 0
    assert still_running == 0, f"{still_running} of 30 still counted as running"
