"""A per-request timeout that really stops the work, and a model error in one
request that fails only that request."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from decoding.drafter import DraftContext, DraftProposal
from decoding.engine import Engine
from drafters.ngram import NgramDrafter, NgramState
from gateway.server import create_app
from runtime.runner.causal_lm import CausalLM
from tests.gateway.conftest import live_server, openai_client, tiny_settings
from tests.reliability.conftest import Measure
from tests.reliability.support import (
    TINY,
    ServeProcess,
    assert_openai_error,
    is_idle,
    scrape,
    serve,
    sse_data,
    wait_for,
)

# a request that never ends must fail the test, not hang the suite
pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 0.3
LONG = 12000  # far more tokens than the time limit allows (30 s of work or more, 0.3 s allowed)
IDLE_WITHIN_S = 60.0  # a ceiling only a hang reaches: how soon is not what is tested
QUESTION = [{"role": "user", "content": "Describe the ocean in great detail."}]


def long_request(stream: bool) -> dict[str, Any]:
    return {"model": TINY, "messages": QUESTION, "max_tokens": LONG, "temperature": 0,
            "stream": stream}


def generated_tokens(server: ServeProcess) -> float:
    return scrape(server.metrics_url).get("specserve_generation_tokens_total", 0.0)


def assert_work_stopped(server: ServeProcess, generated_before: float,
                        requests: int = 1) -> float:
    """The engine goes idle after the timeout, having generated a small part of what was
    asked for, and generates nothing more; returns the seconds it took to become idle."""
    began = time.monotonic()
    assert wait_for(lambda: is_idle(server.url), timeout=IDLE_WITHIN_S), \
        httpx.get(f"{server.url}/ready").json()
    idle = time.monotonic() - began
    generated = generated_tokens(server)
    assert generated - generated_before < requests * LONG // 4, "the work ran on"
    time.sleep(0.5)
    assert generated_tokens(server) == generated, "tokens were still being generated"
    return idle


@pytest.fixture(scope="module")
def timeout_server(tiny_long_context_dir: Path) -> Iterator[ServeProcess]:
    flags = ("--request-timeout", str(TIMEOUT_S), "--max-active", "1", "--max-tokens",
             str(LONG), "--log-level", "warning")
    with serve(tiny_long_context_dir, *flags) as server:
        yield server


def test_timeout_stops_a_whole_response(timeout_server: ServeProcess,
                                        measure: Measure) -> None:
    before = generated_tokens(timeout_server)
    began = time.monotonic()
    response = httpx.post(f"{timeout_server.url}/v1/chat/completions",
                          json=long_request(False), timeout=60)
    answered = time.monotonic() - began
    assert_openai_error(response, 504, "request_timeout")
    idle = assert_work_stopped(timeout_server, before)
    measure(timeout_s=TIMEOUT_S, answered_after_s=round(answered, 3),
            idle_after_answer_s=round(idle, 3))


def test_timeout_ends_a_stream_with_an_error_event(timeout_server: ServeProcess) -> None:
    before = generated_tokens(timeout_server)
    response = httpx.post(f"{timeout_server.url}/v1/chat/completions",
                          json=long_request(True), timeout=60)
    assert response.status_code == 200
    events = sse_data(response.text)
    assert len(events) >= 2 and "[DONE]" not in events
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(events[-1])["error"]["code"] == "request_timeout"
    assert_work_stopped(timeout_server, before)


def test_timeout_also_ends_requests_still_queued(timeout_server: ServeProcess) -> None:
    """With one slot, two of three requests time out while waiting."""
    before = generated_tokens(timeout_server)
    with ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(
            lambda _: httpx.post(f"{timeout_server.url}/v1/chat/completions",
                                 json=long_request(False), timeout=60), range(3)))
    for response in responses:
        assert_openai_error(response, 504, "request_timeout")
    assert_work_stopped(timeout_server, before, requests=3)
    timeout_server.assert_clean_log()


# -- a model error in one request --------------------------------------------------------


class FaultyDrafter(NgramDrafter):
    """An n-gram drafter whose ``fail_at``-th proposal of a sequence raises: a model
    fault on demand, part way through one request."""

    name = "faulty"

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self._calls: dict[int, int] = {}
        self._lock = threading.Lock()

    def propose(self, state: NgramState, context: DraftContext, k: int) -> DraftProposal:
        with self._lock:
            calls = self._calls[id(state)] = self._calls.get(id(state), 0) + 1
        if calls >= self.fail_at:
            raise RuntimeError("injected fault in /secret/weights")
        return super().propose(state, context, k)

    def release(self, state: NgramState) -> None:
        with self._lock:
            self._calls.pop(id(state), None)


@pytest.fixture(scope="module")
def faulty_engine(tiny_target: CausalLM) -> Iterator[Engine]:
    drafters = {"ngram": NgramDrafter(), "faulty": FaultyDrafter(fail_at=3)}
    engine = Engine(tiny_target, drafters, default_drafter="ngram")
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def faulty_url(faulty_engine: Engine) -> Iterator[str]:
    with live_server(create_app(tiny_settings(), engine=faulty_engine)) as url:
        yield url


def good_stream(client: openai.OpenAI, prompt: str) -> str:
    chunks = client.completions.create(model=TINY, prompt=prompt, max_tokens=24,
                                       temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def faulty_request(client: openai.OpenAI, stream: bool, received: list[Any]) -> None:
    """A request on the faulty drafter; raises the SDK's error for the failure."""
    extra = {"speculation": {"drafter": "faulty"}}
    messages: Any = QUESTION
    if not stream:
        client.chat.completions.create(model=TINY, messages=messages, max_tokens=64,
                                       temperature=0, extra_body=extra)
        return
    for chunk in client.chat.completions.create(model=TINY, messages=messages, max_tokens=64,
                                                temperature=0, stream=True, extra_body=extra):
        received.append(chunk)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_model_error_fails_only_its_request(faulty_url: str, faulty_engine: Engine,
                                            stream: bool) -> None:
    client = openai_client(faulty_url)
    prompts = [f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(4)]
    expected = [good_stream(client, p) for p in prompts]
    received: list[Any] = []
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        good = [pool.submit(good_stream, client, p) for p in prompts]
        bad = pool.submit(faulty_request, client, stream, received)
        texts = [f.result(timeout=120) for f in good]
        error_type = openai.InternalServerError if not stream else openai.APIError
        with pytest.raises(error_type) as caught:
            bad.result(timeout=120)
    assert texts == expected, "a request next to the failing one came out wrong"
    assert bool(received) == stream, "a stream fails part way, after its first chunks"
    assert "secret" not in str(caught.value), "the error leaked internals"
    assert wait_for(lambda: faulty_engine.num_running + faulty_engine.num_waiting == 0, 5)
    assert good_stream(client, prompts[0]) == expected[0]  # and the engine goes on
