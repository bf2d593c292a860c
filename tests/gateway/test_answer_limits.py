"""How long an answer may be, through the official ``openai`` client against real
servers: without ``max_tokens`` it runs to the end of the context (OpenAI's and vLLM's
rule, which clients such as Codex CLI and Open WebUI count on), and only an operator's
``--max-tokens`` cuts it, with ``length`` and a log line.

The answers are made long by a grammar: a JSON string of 600 digits, one token each in
the default model's vocabulary (which the tiny model shares), so a finished answer has
more than 600 tokens whatever the random model prefers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from decoding.engine import Engine
from drafters.ngram import NgramDrafter
from gateway.decode.plan import plan_request
from gateway.server import create_app
from gateway.wire.requests import ChatCompletionRequest, CompletionRequest
from runtime.runner.batched import BatchedLM
from runtime.runner.passes import BLOCK
from tests.gateway.conftest import (
    CHAT,
    TINY,
    in_process,
    live_server,
    openai_client,
    tiny_settings,
)

DIGITS = 600
SCHEMA = {"type": "string", "pattern": f"^[0-9]{{{DIGITS}}}$"}
CAP = 100


@pytest.fixture(scope="module")
def long_engine(tiny_long_context_dir: Path) -> Iterator[Engine]:
    """The tiny model with a 16k context: room for answers far past 512 tokens."""
    engine = Engine(BatchedLM.load(str(tiny_long_context_dir), dtype="float32"),
                    {"ngram": NgramDrafter()}, default_drafter="ngram")
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def uncapped(long_engine: Engine) -> Iterator[openai.OpenAI]:
    with live_server(create_app(tiny_settings(), engine=long_engine)) as url:
        yield openai_client(url)


@pytest.fixture(scope="module")
def capped(long_engine: Engine) -> Iterator[openai.OpenAI]:
    with live_server(create_app(tiny_settings(max_tokens=CAP), engine=long_engine)) as url:
        yield openai_client(url)


def _digits(client: openai.OpenAI, **extra: Any) -> Any:
    return client.completions.create(
        model=TINY, prompt="Digits:", temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "digits", "schema": SCHEMA}}}, **extra)


def test_without_max_tokens_an_answer_is_not_cut_at_512(uncapped: openai.OpenAI) -> None:
    out = _digits(uncapped)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == '"' + out.choices[0].text.strip('"') + '"'
    assert len(out.choices[0].text) == DIGITS + 2
    assert out.usage is not None and out.usage.completion_tokens > DIGITS
    response = uncapped.responses.create(
        model=TINY, input="Digits:", temperature=0,
        text={"format": {"type": "json_schema", "name": "digits", "schema": SCHEMA}})
    assert response.status == "completed" and response.incomplete_details is None
    assert len(response.output_text) == DIGITS + 2
    assert response.usage is not None and response.usage.output_tokens > DIGITS


def test_the_operator_cap_cuts_with_length_and_says_so(
        capped: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="gateway.predict.run"):
        unasked = _digits(capped)
        more = _digits(capped, max_tokens=CAP + 50)
        within = _digits(capped, max_tokens=CAP - 40)
        response = capped.responses.create(
            model=TINY, input="Digits:", temperature=0,
            text={"format": {"type": "json_schema", "name": "digits", "schema": SCHEMA}})
    for out in (unasked, more):
        assert out.choices[0].finish_reason == "length"
        assert out.usage is not None and out.usage.completion_tokens == CAP
    assert within.choices[0].finish_reason == "length"
    assert within.usage is not None and within.usage.completion_tokens == CAP - 40
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == CAP
    lines = [r.getMessage() for r in caplog.records if "operator cap" in r.getMessage()]
    cut = {unasked.id, more.id, response.id}
    assert len(lines) == len(cut), lines  # the request's own limit logs nothing
    for request_id in cut:
        line = next(line for line in lines if request_id in line)
        assert f"at {CAP} tokens" in line and "--max-tokens" in line


POOL_BLOCKS = 20  # a KV pool of 320 positions: fewer than the context, and than the digits


@pytest.fixture(scope="module")
def small_pool(tiny_long_context_dir: Path) -> Iterator[openai.OpenAI]:
    target = BatchedLM.load(str(tiny_long_context_dir), dtype="float32")
    engine = Engine(target, {"ngram": NgramDrafter()}, default_drafter="ngram",
                    max_kv_bytes=POOL_BLOCKS * target.kv_block_bytes)
    engine.start()
    try:
        settings = tiny_settings(kv_cache_bytes=POOL_BLOCKS * target.kv_block_bytes)
        with live_server(create_app(settings, engine=engine)) as url:
            yield openai_client(url)
    finally:
        engine.shutdown()


def test_without_max_tokens_an_answer_runs_to_the_pool_s_end(small_pool: openai.OpenAI
                                                             ) -> None:
    """Where the KV pool holds fewer positions than the context, an answer without a
    limit runs exactly to the pool's last position; a prompt whose blocks alone pass the
    pool is a 400 that names the budget."""
    out = _digits(small_pool)
    assert out.usage is not None
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == POOL_BLOCKS * BLOCK - 1
    with pytest.raises(openai.BadRequestError) as refused:
        small_pool.completions.create(model=TINY, prompt="word " * (POOL_BLOCKS * BLOCK),
                                      max_tokens=4)
    assert refused.value.code == "context_length_exceeded"
    assert "--kv-cache-bytes" in refused.value.message


async def test_without_max_tokens_the_limit_is_exactly_the_context_left(
        long_engine: Engine) -> None:
    """Without ``max_tokens`` each choice's limit is the model's context less its own
    prompt's tokens, exactly: no silent cap anywhere below the 16k context, as the routes
    plan it with the gateway's own limits."""
    app = create_app(tiny_settings(), engine=long_engine)
    context = long_engine.target.max_context
    assert context == 16384
    async with in_process(app):
        state = app.state.gateway
        completion = CompletionRequest.model_validate({
            "model": TINY, "prompt": ["Digits:", "A longer prompt, of more tokens than one."],
            "n": 2})
        chat = ChatCompletionRequest.model_validate({"model": TINY, "messages": CHAT})
        for request in (completion, chat):
            plan = await plan_request(state, long_engine, request, "test", TINY)
            lengths = [len(plan.job.prompt_of(i).ids) for i in range(len(plan.requests))]
            assert len(set(lengths)) == (2 if request is completion else 1)
            assert [r.max_new_tokens for r in plan.requests] == [context - n for n in lengths]
            assert plan.operator_cap is None


async def test_without_max_tokens_an_answer_ends_at_the_context_s_last_position(
        client: httpx.AsyncClient, tiny_engine: Engine) -> None:
    """An answer that would run on (600 digits) stops with ``length`` where prompt and
    answer fill the 512-token context exactly."""
    response = await client.post("/v1/completions", json={
        "model": TINY, "prompt": "Digits:", "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "digits", "schema": SCHEMA}}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    usage = body["usage"]
    assert tiny_engine.target.max_context == 512
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 512
