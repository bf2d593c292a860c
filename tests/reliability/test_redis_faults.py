"""Redis faults under load, on a real ``specserve serve`` process sharing its
prefix cache through a real redis-server: Redis killed and restarted, paused
(SIGSTOP, so every call times out), blocked by ``DEBUG SLEEP``, and answering
garbage. Not one request may fail, and every greedy output must equal that of a
server without a prefix cache."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis
from pydantic import ValidationError

from gateway.server import build_drafters
from gateway.service.settings import Settings
from runtime.runner.causal_lm import CausalLM
from tests.conftest import RedisServer
from tests.reliability.conftest import Measure
from tests.reliability.support import (
    TINY,
    ServeProcess,
    scrape,
    serve_many,
    sse_data,
    stream_text,
    wait_for,
)

# a request that never ends must fail the test, not hang the suite
pytestmark = pytest.mark.timeout(300)

BLOCK = 16  # small prefix-cache blocks, so that every prompt spans several
NEW_TOKENS = 12
CLIENTS = 3
PREAMBLE = ("You are a careful assistant for a harbour office. Keep answers short, name "
            "the vessel, and never invent cargo that is not in the ledger. ")
QUESTIONS = ("Which ship came in first?", "What was the weather at noon?",
             "Who signed the ledger?", "How many crates were unloaded?")
FLAGS = ("--max-tokens", "64", "--prefix-block-tokens", str(BLOCK), "--log-level", "warning")


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": PREAMBLE * 3},
            {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


def complete(url: str, i: int, stream: bool) -> str:
    """One greedy completion; raises unless it succeeded completely."""
    payload = {"model": TINY, "messages": prompt(i), "max_tokens": NEW_TOKENS,
               "temperature": 0, "stream": stream}
    response = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text[:300]
    if stream:
        events = sse_data(response.text)
        assert events[-1] == "[DONE]", events[-2:]
        return stream_text(events)[0]
    return str(response.json()["choices"][0]["message"]["content"])


@dataclass
class Load:
    """Clients sending requests in a loop until stopped; every answer is checked."""

    url: str
    expected: list[str]
    done: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, seed: int) -> None:
        i = seed
        while not self._stop.is_set():
            try:
                text = complete(self.url, i, stream=i % 2 == 0)
                ok = text == self.expected[i % len(QUESTIONS)]
                problem = None if ok else f"prompt {i % len(QUESTIONS)} gave {text!r}"
            except Exception as exc:  # any failure is what this test counts
                problem = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.done += 1
                if problem is not None:
                    self.failures.append(problem)
            i += 1

    def during(self, fault: Callable[[], None]) -> None:
        """Run ``fault`` while the clients keep sending."""
        self._stop.clear()
        with ThreadPoolExecutor(CLIENTS) as pool:
            for seed in range(CLIENTS):
                pool.submit(self.client, seed)
            try:
                fault()
            finally:
                self._stop.set()


def cache_counters(server: ServeProcess) -> tuple[float, float]:
    samples = scrape(server.metrics_url)
    return samples["specserve_prefix_cache_hits_total"], samples["specserve_cache_errors_total"]


@pytest.fixture(scope="module")
def cache_redis() -> Iterator[RedisServer]:
    server = RedisServer("--enable-debug-command", "yes")
    server.start()
    yield server
    if server.process is not None:
        server.process.send_signal(signal.SIGCONT)
    server.stop()


@pytest.fixture(scope="module")
def servers(tiny_target_dir: Path, cache_redis: RedisServer
            ) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    """A server on Redis and one without any prefix cache, for the reference."""
    flag_sets = [(*FLAGS, "--redis-url", cache_redis.url, "--redis-timeout", "0.05"),
                 (*FLAGS, "--no-prefix-cache")]
    with serve_many(flag_sets, tiny_target_dir) as (cached, plain):
        yield cached, plain


# Each fault lasts until the cached server has counted a cache error (an event, not a
# time: on a busy machine the clients may be slow to reach Redis), then Redis is made
# whole and the load goes on until the server hits its cache again, which it can only do
# once the circuit it opened has closed. The ceiling is there only for a hang.
EVENT_CEILING_S = 120.0


def errors_counted(cached: ServeProcess, before: float) -> Callable[[], bool]:
    return lambda: cache_counters(cached)[1] > before


def hits_resumed(cached: ServeProcess) -> bool:
    before = cache_counters(cached)[0]
    return wait_for(lambda: cache_counters(cached)[0] > before, timeout=EVENT_CEILING_S)


def killed_and_restarted(server: RedisServer, counted: Callable[[], bool]) -> None:
    server.stop()
    try:
        assert wait_for(counted, timeout=EVENT_CEILING_S)
    finally:
        server.start()


def paused(server: RedisServer, counted: Callable[[], bool]) -> None:
    assert server.process is not None
    server.process.send_signal(signal.SIGSTOP)
    try:
        assert wait_for(counted, timeout=EVENT_CEILING_S)
    finally:
        server.process.send_signal(signal.SIGCONT)


def sleeping(server: RedisServer, counted: Callable[[], bool]) -> None:
    """``DEBUG SLEEP`` blocks the whole server; sent again until a read has timed out."""
    client = redis.Redis.from_url(server.url, socket_timeout=30)
    deadline = time.monotonic() + EVENT_CEILING_S
    while not counted():
        assert time.monotonic() < deadline, "no cache read timed out"
        client.execute_command("DEBUG", "SLEEP", "1")


def garbage(server: RedisServer, counted: Callable[[], bool]) -> None:
    """Every cached value overwritten, again until the server has rejected one."""
    client = redis.Redis.from_url(server.url)
    deadline = time.monotonic() + EVENT_CEILING_S
    while not counted():
        assert time.monotonic() < deadline, "no corrupt block was read"
        keys = list(client.scan_iter(count=1000))
        assert keys, "nothing was cached"
        for key in keys:
            client.set(key, b"\x00not a kv block\xff" * 8)
        time.sleep(0.2)


def test_redis_faults_under_load(servers: tuple[ServeProcess, ServeProcess],
                                 cache_redis: RedisServer, measure: Measure) -> None:
    cached, plain = servers
    expected = [complete(plain.url, i, stream=False) for i in range(len(QUESTIONS))]
    load = Load(cached.url, expected)
    load.during(lambda: assert_true(hits_resumed(cached)))  # fills the cache, then hits it
    phases: dict[str, Callable[[RedisServer, Callable[[], bool]], None]] = {
        "killed and restarted": killed_and_restarted,
        "paused (SIGSTOP)": paused,
        "DEBUG SLEEP": sleeping,
        "garbage values": garbage,
    }
    errors_seen, recovered = {}, {}
    for name, fault in phases.items():
        before = cache_counters(cached)[1]

        def faulted_then_recovered(fault: Callable[..., None] = fault, name: str = name,
                                   before: float = before) -> None:
            fault(cache_redis, errors_counted(cached, before))
            recovered[name] = hits_resumed(cached)

        load.during(faulted_then_recovered)
        errors_seen[name] = cache_counters(cached)[1] - before
    measure(requests=load.done, failed=len(load.failures), cache_errors=errors_seen,
            recovered=recovered)
    assert not load.failures, load.failures[:5]
    assert all(count >= 1 for count in errors_seen.values()), errors_seen
    assert all(recovered.values()), f"the cache did not recover: {recovered}"
    assert cached.process.poll() is None
    cached.assert_clean_log()


def assert_true(value: bool) -> None:
    assert value


def test_no_prefix_cache_keeps_the_default_draft_usable(tiny_target: CausalLM) -> None:
    """Regression: ``serve --no-prefix-cache`` with the default draft failed to load
    ("the 'cache' drafter needs the prefix cache")."""
    drafters, default, backend = build_drafters(Settings(prefix_cache=False), tiny_target, None)
    assert "cache" not in drafters
    assert default == "ngram" and backend == "builtin"  # the shipped draft fits no tiny target
    assert Settings(prefix_cache=False, draft="ngram+draft-model").draft == "ngram+draft-model"
    with pytest.raises(ValidationError, match="uses the prefix cache"):
        Settings(prefix_cache=False, draft="ngram+cache")
