"""Gateway fixtures: engines on the tiny model, the app in-process (httpx
ASGITransport) and on a real uvicorn server bound to a free loopback port."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from decoding.drafter import Drafter
from decoding.engine import Engine
from drafters.model import ModelDrafter
from drafters.ngram import NgramDrafter
from drafters.prediction import PredictionDrafter
from gateway.server import create_app
from gateway.service.settings import Settings
from observability.metrics import Metrics
from runtime.runner.causal_lm import CausalLM
from tests.conftest import KEPT_VARIABLES

TINY = "tiny"
CHAT = [{"role": "user", "content": "Say something."}]


def tiny_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {"served_model_name": TINY, "api_keys": [], "cors_origins": []}
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(autouse=True)
def _no_specserve_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings come from each test, not from the caller's environment."""
    import os

    for name in list(os.environ):
        if name.startswith("SPECSERVE_") and name not in KEPT_VARIABLES:
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def tiny_engine(tiny_target: CausalLM, tiny_draft: CausalLM) -> Iterator[Engine]:
    drafters: dict[str, Drafter] = {"ngram": NgramDrafter(),
                                    "draft": ModelDrafter(tiny_draft, tiny_target)}
    engine = Engine(tiny_target, drafters, default_drafter="ngram",
                    predicted=PredictionDrafter.around)
    engine.start()
    yield engine
    engine.shutdown()


IN_PROCESS_CEILING_S = 300.0  # one whole in-process response, a stream's included: a hang


class BoundedASGITransport(httpx.ASGITransport):
    """httpx's ASGI transport, which ignores the client's timeouts and returns a response
    once the app has sent all of it: each request gets a ceiling of its own, so a stream
    that never ends fails its test saying so, not at the suite's timeout."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await asyncio.wait_for(super().handle_async_request(request),
                                          IN_PROCESS_CEILING_S)
        except TimeoutError:
            pytest.fail(f"{request.method} {request.url.path}: the app sent no whole response "
                        f"within {IN_PROCESS_CEILING_S:.0f} s (a stream that never ended?)",
                        pytrace=False)


@asynccontextmanager
async def in_process(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan running, reached through httpx's ASGI transport."""
    async with app.router.lifespan_context(app):
        transport = BoundedASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     timeout=60) as client:
            yield client


@pytest.fixture
async def client(tiny_engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with in_process(create_app(tiny_settings(), engine=tiny_engine)) as c:
        yield c


@contextmanager
def live_server(app: FastAPI) -> Iterator[str]:
    """Run ``app`` on a real uvicorn server in a thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def tiny_url(tiny_engine: Engine) -> Iterator[str]:
    with live_server(create_app(tiny_settings(), engine=tiny_engine)) as url:
        yield url


def openai_client(base_url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=120)


def wait_until(predicate: Any, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def metric_total(metrics: Metrics, name: str, **labels: str) -> float:
    """A sample of ``metrics`` (e.g. ``specserve_batch_size_bucket``) summed over the
    label sets that match ``labels``."""
    text = generate_latest(metrics.registry).decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
