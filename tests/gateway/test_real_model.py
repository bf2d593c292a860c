"""The real default model behind a real server: greedy output over HTTP equals
plain target decoding, and a client that leaves frees its slot at once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from decoding.engine import Engine
from decoding.prompting import encode_chat
from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams
from drafters.ngram import NgramDrafter
from gateway.server import create_app
from gateway.service.settings import Settings
from observability.telemetry import Telemetry
from runtime.runner.causal_lm import CausalLM
from tests.gateway.conftest import live_server, metric_total, openai_client, wait_until

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
# what a client that leaves asks for: minutes of work here, so it is still running
# when the client goes on any machine (400 was seconds: a fast machine could finish)
LEAVING_TOKENS = 6000
LONG_PROMPT = "Here is a long list of fruits, one per line, with a short description of each:\n"


@pytest.fixture(scope="module")
def real_engine(default_target: CausalLM) -> Iterator[Engine]:
    engine = Engine(default_target, {"ngram": NgramDrafter()}, default_drafter="ngram")
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def telemetry() -> Telemetry:
    return Telemetry(MODEL)


@pytest.fixture(scope="module")
def real_url(real_engine: Engine, telemetry: Telemetry) -> Iterator[str]:
    with live_server(create_app(Settings(api_keys=[], cors_origins=[],
                                         max_tokens=LEAVING_TOKENS),
                                engine=real_engine, telemetry=telemetry)) as url:
        yield url


def generated(telemetry: Telemetry) -> float:
    return metric_total(telemetry.metrics, "specserve_generation_tokens_total")


# a request cancelled within a round of its client leaving has sent a small part of what it
# asked for, however slow the machine (a count of work, not a time), and is gone long
# before its LEAVING_TOKENS could be made (minutes here; the ceiling has room for a busy CPU)
LEFT_EARLY = LEAVING_TOKENS // 4
GONE_WITHIN_S = 30


@pytest.mark.parametrize("question", [
    "Correct the grammar: she go to school every days.",
    "What is the capital of France? Answer in one sentence.",
])
def test_greedy_http_equals_plain_decoding(real_url: str, default_target: CausalLM,
                                           question: str) -> None:
    messages: list[Any] = [{"role": "user", "content": question}]
    request = GenerationRequest(
        prompt_ids=tuple(encode_chat(default_target.tokenizer, messages)), max_new_tokens=32,
        sampling=SamplingParams(temperature=0.0))
    expected = "".join(event.text for event in decode(default_target, None, request))
    client = openai_client(real_url)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32,
                                           temperature=0)
    assert whole.choices[0].message.content == expected
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, temperature=0, stream=True) if c.choices)
    assert streamed == expected


def test_disconnect_mid_stream_frees_the_slot(real_url: str, real_engine: Engine,
                                              telemetry: Telemetry,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway")
    before = generated(telemetry)
    client = openai_client(real_url)
    other: dict[str, Any] = {}

    def keep_streaming() -> None:
        chunks = list(client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=48,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        other["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        other["tokens"] = chunks[-1].usage.completion_tokens if chunks[-1].usage else 0

    survivor = threading.Thread(target=keep_streaming)
    survivor.start()
    assert wait_until(lambda: real_engine.num_running == 1, timeout=30)
    payload = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": LEAVING_TOKENS,
               "temperature": 0,
               "stream": True}
    with httpx.Client(timeout=60) as http, \
            http.stream("POST", f"{real_url}/v1/completions", json=payload) as response:
        data = 0
        for line in response.iter_lines():
            data += line.startswith("data:")
            if data == 2:
                running = real_engine.num_running
                break  # leave after two chunks: the connection closes here
    assert running == 2 or not survivor.is_alive()
    # the cancelled request is gone within a round, long before its tokens could be made
    assert wait_until(lambda: real_engine.num_running <= (1 if survivor.is_alive() else 0),
                      timeout=GONE_WITHIN_S)
    survivor.join(timeout=120)
    assert other == {"finish": "length", "tokens": 48}
    assert wait_until(lambda: real_engine.num_running == 0, timeout=GONE_WITHIN_S)
    assert generated(telemetry) - before < 48 + LEFT_EARLY
    assert any("client disconnected" in r.getMessage() for r in caplog.records)


def test_disconnect_while_waiting_for_a_whole_response(real_url: str, real_engine: Engine,
                                                       telemetry: Telemetry) -> None:
    before = generated(telemetry)
    payload = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": LEAVING_TOKENS,
               "temperature": 0}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=httpx.Timeout(60, read=1.5)) \
            as http:
        http.post(f"{real_url}/v1/completions", json=payload)
    assert wait_until(lambda: real_engine.num_running == 0, timeout=GONE_WITHIN_S)
    assert generated(telemetry) - before < LEFT_EARLY
    # The freed slot serves the next request at once.
    r = openai_client(real_url).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert r.usage is not None and r.usage.completion_tokens == 2


def test_unsupported_field_on_the_real_server(real_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(real_url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            logit_bias={"42": 10})
    assert info.value.body["param"] == "logit_bias"
