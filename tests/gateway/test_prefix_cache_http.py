"""Two server instances sharing one real Redis: the second reuses the first's work."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from decoding.engine import Engine
from decoding.prefix_cache import InProcessStore
from gateway.server import build_engine, create_app
from gateway.service import redis_store
from gateway.service.redis_store import RedisStore
from observability.metrics import start_metrics_server
from tests.conftest import RedisServer
from tests.gateway.conftest import (
    TINY,
    in_process,
    live_server,
    openai_client,
    tiny_settings,
    wait_until,
)

PASSAGE = ("The harbour master kept a ledger of every vessel that entered the bay, noting its "
           "name, its cargo, the weather and the hour of arrival. ") * 4


@pytest.fixture()
def replicas(tiny_target_dir: Path, redis_server: RedisServer) -> Iterator[list[Engine]]:
    engines = []
    for _ in range(2):
        settings = tiny_settings(target=str(tiny_target_dir), redis_url=redis_server.url,
                                 prefix_block_tokens=16, draft="ngram+cache")
        engines.append(build_engine(settings))
    yield engines
    for engine in engines:
        engine.shutdown()


def _complete(url: str, **extra: object) -> tuple[str, int, dict[str, int]]:
    reply = openai_client(url).completions.create(
        model=TINY, prompt=PASSAGE, max_tokens=24, temperature=0, **extra)  # type: ignore[call-overload]
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return (reply.choices[0].text, usage.prompt_tokens_details.cached_tokens or 0,
            reply.model_extra["speculation"])


def test_second_replica_hits_and_outputs_are_unchanged(
    replicas: list[Engine], redis_server: RedisServer, tiny_target_dir: Path
) -> None:
    settings = tiny_settings(target=str(tiny_target_dir), redis_url=redis_server.url)
    apps = [create_app(settings, engine=e) for e in replicas]
    with live_server(apps[0]) as url_a, live_server(apps[1]) as url_b:
        text_a, cached_a, _ = _complete(url_a)
        assert replicas[0].prefix_cache is not None and replicas[0].prefix_cache.store.flush()
        text_b, cached_b, _ = _complete(url_b)
        assert cached_a == 0 and cached_b > 0
        assert text_a == text_b
        # the continuation drafter replays the earlier answer as drafts
        text_c, _, spec = _complete(url_b, extra_body={"speculation": {"drafter": "cache"}})
        assert text_c == text_a and spec["accepted_tokens"] >= 15
        redis_server.stop()  # Redis dies: requests still succeed, unchanged
        for _ in range(2):
            assert _complete(url_b)[0] == text_a
    scrape = generate_latest(apps[1].state.gateway.telemetry.metrics.registry).decode()
    assert 'specserve_cache_errors_total{store="redis"}' in scrape
    errors = [line for line in scrape.splitlines()
              if line.startswith('specserve_cache_errors_total{store="redis"}')]
    assert float(errors[0].split()[-1]) >= 1


UNRESOLVED = "redis://:secret@specserve-no-such-redis.invalid:6379/0"


def test_a_redis_that_cannot_be_reached_is_logged_at_start_and_shown_by_ready(
    tiny_target_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica whose Redis name does not resolve says so at start-up and in /ready, and
    still serves (the cache is optional)."""
    settings = tiny_settings(target=str(tiny_target_dir), redis_url=UNRESOLVED)
    with caplog.at_level(logging.WARNING, logger="gateway.server"):
        engine = build_engine(settings)
    try:
        (record,) = [r for r in caplog.records if "not reachable" in r.getMessage()]
        assert record.levelno == logging.WARNING
        message = record.getMessage()
        assert "specserve-no-such-redis.invalid" in message and "secret" not in message
        with live_server(create_app(settings, engine=engine)) as url:
            ready = httpx.get(f"{url}/ready", timeout=10)
            assert ready.status_code == 200
            cache = ready.json()["prefix_cache"]
            assert cache["store"] == "redis" and cache["reachable"] is False
            assert cache["url"] == "redis://:***@specserve-no-such-redis.invalid:6379/0"
            assert "Error" in cache["error"] and "secret" not in cache["error"]
            text, cached, _ = _complete(url)
            assert text and cached == 0
    finally:
        engine.shutdown()


def test_ready_follows_redis_going_away(
    tiny_target_dir: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_store, "HEALTH_MAX_AGE_S", 0.0)  # ping on every /ready
    settings = tiny_settings(target=str(tiny_target_dir), redis_url=redis_server.url)
    engine = build_engine(settings)
    try:
        with live_server(create_app(settings, engine=engine)) as url:
            cache = httpx.get(f"{url}/ready", timeout=10).json()["prefix_cache"]
            assert cache == {"store": "redis", "reachable": True, "url": redis_server.url,
                             "error": None}
            redis_server.stop()
            ready = httpx.get(f"{url}/ready", timeout=10)
            assert ready.status_code == 200
            assert ready.json()["prefix_cache"]["reachable"] is False
    finally:
        engine.shutdown()


def test_ready_shows_the_in_process_store(tiny_target_dir: Path) -> None:
    settings = tiny_settings(target=str(tiny_target_dir))
    engine = build_engine(settings)
    try:
        with live_server(create_app(settings, engine=engine)) as url:
            cache = httpx.get(f"{url}/ready", timeout=10).json()["prefix_cache"]
            assert cache == {"store": "in-process", "reachable": True, "url": None,
                             "error": None}
    finally:
        engine.shutdown()


@pytest.mark.parametrize("redis", [False, True], ids=["in-process", "redis"])
def test_the_served_cache_size_gauge_is_the_in_process_store_s_size(
        tiny_target_dir: Path, redis_server: RedisServer, redis: bool) -> None:
    """Scraped from the metrics port as ``serve`` runs it: after a request, the gauge is
    the in-process store's size (not its bound); with Redis there is no such gauge."""
    settings = tiny_settings(target=str(tiny_target_dir), prefix_block_tokens=16,
                             redis_url=redis_server.url if redis else None)
    engine = build_engine(settings)
    app = create_app(settings, engine=engine)
    metrics = start_metrics_server(app.state.gateway.telemetry.metrics, "127.0.0.1", 0)
    try:
        with live_server(app) as url:
            _complete(url)
            assert wait_until(lambda: engine.num_running + engine.num_waiting == 0, 10)
            assert engine.prefix_cache is not None and engine.prefix_cache.store.flush()
            text = httpx.get(f"http://127.0.0.1:{metrics.server_port}/metrics",
                             timeout=10).text
    finally:
        metrics.shutdown()
        engine.shutdown()
    store = engine.prefix_cache.store
    samples = {sample.name: sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples}
    assert samples["specserve_prefix_cache_lookups_total"] == 1  # the cache is exported
    if redis:
        assert isinstance(store, RedisStore)
        assert "specserve_prefix_cache_bytes" not in samples
    else:
        assert isinstance(store, InProcessStore)
        assert 0 < store.size_bytes < store.max_bytes
        assert samples["specserve_prefix_cache_bytes"] == store.size_bytes


async def test_cached_tokens_count_once_per_prompt_with_several_choices(
        tiny_target_dir: Path) -> None:
    """With ``n`` > 1 the prompt's cached tokens count once, as its prompt tokens do: a
    request of 2 or 3 choices over a cached prompt reports what one choice does, whole and
    streamed."""
    settings = tiny_settings(target=str(tiny_target_dir), prefix_block_tokens=16,
                             draft="ngram")
    engine = build_engine(settings)
    try:
        async with in_process(create_app(settings, engine=engine)) as client:
            async def usage(n: int, stream: bool = False) -> dict[str, Any]:
                body = {"model": TINY, "prompt": PASSAGE, "max_tokens": 4, "temperature": 0,
                        "n": n}
                if not stream:
                    response = await client.post("/v1/completions", json=body)
                    assert response.status_code == 200, response.text
                    return dict(response.json()["usage"])
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                response = await client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                          if line.startswith("data: {")]
                return dict(next(c["usage"] for c in chunks if c.get("usage")))

            cold = await usage(1)
            assert cold["prompt_tokens_details"]["cached_tokens"] == 0
            one = await usage(1)
            cached = one["prompt_tokens_details"]["cached_tokens"]
            assert 0 < cached <= one["prompt_tokens"]
            assert cached % 16 == 0 and one["prompt_tokens"] - cached <= 16  # whole blocks
            for n, stream in ((2, False), (3, False), (2, True)):
                several = await usage(n, stream)
                assert several["prompt_tokens"] == one["prompt_tokens"], (n, stream)
                assert several["prompt_tokens_details"]["cached_tokens"] == cached, (n, stream)
                assert several["completion_tokens"] == n * 4
    finally:
        engine.shutdown()
