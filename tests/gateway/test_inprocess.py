"""The app in-process (httpx ASGITransport) on the tiny model: responses and
every error status."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from decoding.drafter import BaseDrafter, DraftContext, DraftProposal
from decoding.engine import Engine
from decoding.prompting import encode_chat, encode_text
from decoding.types import GenerationRequest
from gateway.server import build_engine, create_app
from gateway.service.settings import Settings, add_settings_flags, settings_from_args
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from tests.gateway.conftest import CHAT, TINY, in_process, tiny_settings


class FailingDrafter(BaseDrafter):
    """A drafter that breaks on its first proposal: a model fault on demand."""

    name = "boom"

    def begin(self, prompt_ids: Sequence[int]) -> None:
        return None

    def propose(self, state: Any, context: DraftContext, k: int) -> DraftProposal:
        raise RuntimeError("secret internals at /opt/weights")

    def rollback(self, state: Any, length: int) -> None:
        return None

    def release(self, state: Any) -> None:
        return None


def assert_error(response: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return dict(error)


async def test_the_models_stop_strings_reach_chat_requests(
        client: httpx.AsyncClient, tiny_target_dir: Path, tmp_path: Path) -> None:
    """A model whose generation_config.json names stop strings (as Gemma's names
    ``\nUser:``) ends chat answers at them, through the gateway's own limits; a
    completion, which has no chat template, runs past them."""
    body = {"model": TINY, "messages": CHAT, "max_tokens": 24, "temperature": 0}
    text = (await client.post("/v1/chat/completions", json=body)).json()[
        "choices"][0]["message"]["content"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(text) >= 8 and stop.strip(), text
    model = tmp_path / "with-stops"  # the tiny model, its generation_config.json rewritten
    model.mkdir()
    for file in tiny_target_dir.iterdir():
        (model / file.name).symlink_to(file)
    (model / "generation_config.json").unlink(missing_ok=True)
    (model / "generation_config.json").write_text(json.dumps({"stop_strings": [stop]}))
    engine = Engine(BatchedLM.load(str(model), dtype="float32"), {})
    engine.start()
    try:
        async with in_process(create_app(tiny_settings(), engine=engine)) as stopping:
            r = await stopping.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["message"]["content"] == text[:text.index(stop)]
            assert choice["finish_reason"] == "stop"
            ids = encode_chat(engine.target.tokenizer, CHAT)  # the same prompt, as ids
            plain = await stopping.post("/v1/completions", json={
                "model": TINY, "prompt": ids, "max_tokens": 24, "temperature": 0})
            assert plain.json()["choices"][0]["text"] == text, plain.text
    finally:
        engine.shutdown()


async def test_chat_completion(client: httpx.AsyncClient, tiny_target: CausalLM) -> None:
    r = await client.post("/v1/chat/completions",
                          json={"model": TINY, "messages": CHAT, "max_tokens": 6,
                                "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == TINY
    assert r.headers["x-request-id"] == body["id"]
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    prompt_tokens = len(encode_chat(tiny_target.tokenizer, CHAT))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 6,
                             "total_tokens": prompt_tokens + 6,
                             "prompt_tokens_details": {"cached_tokens": 0},
                             "completion_tokens_details": {
                                 "reasoning_tokens": 0, "accepted_prediction_tokens": 0,
                                 "rejected_prediction_tokens": 0}}
    spec = body["speculation"]
    assert spec["drafter"] == "ngram" and spec["rounds"] >= 1
    assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]


async def test_completion_prompt_forms(client: httpx.AsyncClient, tiny_target: CausalLM) -> None:
    texts = ["The cat", "A dog and"]
    base = {"model": TINY, "max_tokens": 4, "temperature": 0}
    r = await client.post("/v1/completions", json={**base, "prompt": texts, "n": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] == choices[1]["text"]  # greedy: both choices agree
    ids = [encode_text(tiny_target.tokenizer, t) for t in texts]
    by_ids = await client.post("/v1/completions", json={**base, "prompt": ids})
    assert [c["text"] for c in by_ids.json()["choices"]] == [choices[0]["text"],
                                                              choices[2]["text"]]
    single = await client.post("/v1/completions", json={**base, "prompt": ids[1]})
    assert single.json()["choices"][0]["text"] == choices[2]["text"]
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == sum(len(i) for i in ids)  # once per prompt, not per n
    assert usage["completion_tokens"] == 16


async def test_models_report_the_dtype_the_draft_model_runs_in(
        tiny_target_dir: Path, tiny_draft_dir: Path) -> None:
    settings = tiny_settings(target=str(tiny_target_dir), draft=str(tiny_draft_dir),
                             draft_backend="torch", draft_dtype="bfloat16", prefix_cache=False)
    card, reply = await _card_and_completion(settings)
    assert card["metadata"]["dtype"] == "float32"
    assert card["metadata"]["draft_dtype"] == "bfloat16"
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]


async def test_health_ready_and_models(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).status_code == 200
    ready = await client.get("/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    models = (await client.get("/v1/models")).json()
    (card,) = models["data"]
    assert models["object"] == "list" and card["id"] == TINY and card["object"] == "model"
    assert card["metadata"]["draft_backend"] == "torch"
    assert card["metadata"]["default_drafter"] == "ngram"
    assert set(card["metadata"]["drafters"]) == {"ngram", "draft", "none"}
    assert card["max_model_len"] == 512
    assert (await client.get(f"/v1/models/{TINY}")).json()["id"] == TINY
    assert_error(await client.get("/v1/models/gpt-4"), 404, code="model_not_found")


async def test_api_keys(tiny_engine: Engine) -> None:
    app = create_app(tiny_settings(api_keys=["k-one", "k-two"]), engine=tiny_engine)
    async with in_process(app) as client:
        payload = {"model": TINY, "messages": CHAT, "max_tokens": 1}
        assert_error(await client.post("/v1/chat/completions", json=payload), 401)
        wrong = await client.post("/v1/chat/completions", json=payload,
                                  headers={"Authorization": "Bearer k-three"})
        assert_error(wrong, 401, code="invalid_api_key")
        assert_error(await client.get("/v1/models", headers={"Authorization": "k-one"}), 401)
        ok = await client.post("/v1/chat/completions", json=payload,
                               headers={"Authorization": "Bearer k-two"})
        assert ok.status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/ready")).status_code == 200


async def test_unknown_model_and_route(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": CHAT})
    assert "gpt-4o" in assert_error(r, 404, param="model", code="model_not_found")["message"]
    alias = await client.post("/v1/chat/completions",
                              json={"model": "default", "messages": CHAT, "max_tokens": 1})
    assert alias.status_code == 200  # the target's aliases are accepted too
    assert_error(await client.get("/v1/embeddings"), 404)
    assert_error(await client.get("/v1/chat/completions"), 405)


async def test_body_limit(tiny_engine: Engine) -> None:
    app = create_app(tiny_settings(max_body_bytes=1024), engine=tiny_engine)
    big = {"model": TINY, "messages": [{"role": "user", "content": "x" * 2000}]}
    async with in_process(app) as client:
        assert_error(await client.post("/v1/chat/completions", json=big), 413)

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
            for _ in range(4):
                yield b" " * 400

        r = await client.post("/v1/completions", content=chunked(),
                              headers={"Content-Type": "application/json"})
        assert "content-length" not in r.request.headers
        assert_error(r, 413, code="payload_too_large")


async def test_bad_requests(client: httpx.AsyncClient) -> None:
    url = "/v1/chat/completions"
    bad_type = await client.post(url, json={"model": TINY, "messages": CHAT,
                                            "temperature": "hot"})
    assert "temperature" in assert_error(bad_type, 400, param="temperature")["message"]
    tools = await client.post(url, json={"model": TINY, "messages": CHAT, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]})
    assert "schema" in assert_error(tools, 400, param="tools")["message"]
    unknown = await client.post(url, json={"model": TINY, "messages": CHAT, "best_of": 2})
    assert_error(unknown, 400, param="best_of", code="unknown_parameter")
    drafter = await client.post(url, json={"model": TINY, "messages": CHAT,
                                           "speculation": {"drafter": "eagle"}})
    assert_error(drafter, 400, param="speculation.drafter")
    not_json = await client.post(url, content=b"{", headers={"Content-Type": "application/json"})
    assert_error(not_json, 400, code="invalid_json")
    oov = await client.post("/v1/completions", json={"model": TINY, "prompt": [1, 10**7]})
    assert_error(oov, 400, param="prompt[0]")


async def test_length_limits(tiny_engine: Engine) -> None:
    app = create_app(tiny_settings(max_tokens=1000, max_prompt_tokens=300), engine=tiny_engine)
    async with in_process(app) as client:
        url = "/v1/completions"
        too_long = await client.post(url, json={"model": TINY, "prompt": [42] * 600})
        assert_error(too_long, 400, param="prompt", code="context_length_exceeded")
        over_cap = await client.post(url, json={"model": TINY, "prompt": [42] * 301})
        assert "300" in assert_error(over_cap, 400, param="prompt")["message"]
        beyond = await client.post(url, json={"model": TINY, "prompt": [42] * 100,
                                              "max_tokens": 450})
        assert_error(beyond, 400, param="max_tokens", code="context_length_exceeded")


async def test_queue_full_is_429(tiny_target: CausalLM) -> None:
    engine = Engine(tiny_target, max_queue=1)  # never started: whatever is queued stays
    app = create_app(tiny_settings(), engine=engine)
    async with in_process(app) as client:
        waiting = engine.submit(GenerationRequest(prompt_ids=(1, 2), max_new_tokens=1))
        r = await client.post("/v1/chat/completions", json={"model": TINY, "messages": CHAT})
        assert_error(r, 429, code="queue_full")
        assert r.headers["retry-after"] == "1"
        waiting.cancel()


async def test_not_ready_and_load_failure(tmp_path: Path) -> None:
    app = create_app(tiny_settings(target=str(tmp_path)))  # no config.json: loading fails
    async with in_process(app) as client:
        state = app.state.gateway
        deadline = time.monotonic() + 120  # a ceiling only a hung load reaches
        while state.load_error is None and time.monotonic() < deadline:
            ready = await client.get("/ready")
            if state.load_error is None:  # not failed by the time /ready answered
                assert ready.status_code == 503 and ready.json()["status"] == "loading"
            await asyncio.sleep(0.01)
        assert state.load_error is not None
        assert (await client.get("/ready")).status_code == 503
        assert (await client.get("/health")).json()["status"] == "failed"
        r = await client.post("/v1/chat/completions", json={"model": TINY, "messages": CHAT})
        assert_error(r, 503, code="load_failed")


async def test_draining_is_503(tiny_target: CausalLM) -> None:
    engine = Engine(tiny_target)
    app = create_app(tiny_settings(), engine=engine)
    async with in_process(app) as client:
        assert (await client.get("/ready")).status_code == 200
        assert await app.state.gateway.drain(timeout=60)
        ready = await client.get("/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        r = await client.post("/v1/chat/completions", json={"model": TINY, "messages": CHAT})
        assert_error(r, 503, code="shutting_down")
        assert (await client.get("/health")).status_code == 200


async def test_model_failure_is_a_sanitised_500(tiny_target: CausalLM) -> None:
    engine = Engine(tiny_target, {"boom": FailingDrafter()}, default_drafter="boom")
    engine.start()
    try:
        async with in_process(create_app(tiny_settings(), engine=engine)) as client:
            r = await client.post("/v1/chat/completions",
                                  json={"model": TINY, "messages": CHAT, "max_tokens": 4})
            error = assert_error(r, 500, code="generation_error")
            assert "secret" not in error["message"] and "/opt" not in r.text
            stream = await client.post("/v1/chat/completions", json={
                "model": TINY, "messages": CHAT, "max_tokens": 4, "stream": True})
            events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
            assert json.loads(events[-1])["error"]["code"] == "generation_error"
            assert "[DONE]" not in events and "secret" not in stream.text
    finally:
        engine.shutdown()


async def test_timeout(tiny_engine: Engine) -> None:
    app = create_app(tiny_settings(request_timeout=1e-6), engine=tiny_engine)
    payload = {"model": TINY, "messages": CHAT, "max_tokens": 4}
    async with in_process(app) as client:
        r = await client.post("/v1/chat/completions", json=payload)
        assert_error(r, 504, code="request_timeout")
        stream = await client.post("/v1/chat/completions", json={**payload, "stream": True})
        assert stream.status_code == 200
        events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[-1])["error"]["code"] == "request_timeout"
        assert "[DONE]" not in events
    assert tiny_engine.num_running == 0


async def test_cors(tiny_engine: Engine) -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    app = create_app(tiny_settings(cors_origins=["https://app.example"]), engine=tiny_engine)
    async with in_process(app) as client:
        r = await client.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        other = await client.options("/v1/chat/completions",
                                     headers={**preflight, "Origin": "https://evil.example"})
        assert other.headers.get("access-control-allow-origin") is None
    async with in_process(create_app(tiny_settings(), engine=tiny_engine)) as client:
        off = await client.get("/health", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in off.headers


async def test_models_report_quantized_weights(tiny_target_dir: Path,
                                               tiny_draft_dir: Path) -> None:
    """A target quantized at load: /v1/models says what its matrices hold and that the
    activations are bfloat16; a draft model beside it follows it into int4."""
    settings = tiny_settings(target=str(tiny_target_dir), draft=str(tiny_draft_dir),
                             draft_backend="torch", quantize="int4", prefix_cache=False)
    card, reply = await _card_and_completion(settings)
    assert card["metadata"]["weights"] == "int4"
    assert card["metadata"]["dtype"] == "bfloat16"
    assert card["metadata"]["draft_dtype"] == "bfloat16"  # int4 codes, bf16 activations
    # the verify curve measured at start-up, the draft model's step against the target's,
    # and the ceiling each drafter can reach by them
    from decoding.policy import MAX_DRAFT_TOKENS

    profile = card["metadata"]["speculation"]
    steps = profile["verify_steps"]
    assert len(steps) == MAX_DRAFT_TOKENS + 1 and steps[0] == 1.0 and steps == sorted(steps)
    assert profile["step_ms"] > 0 and profile["draft_cost"]["lookup"] == 0.0
    models = set(profile["draft_cost"]) - {"lookup"}
    assert models and all(profile["draft_cost"][m] > 0 for m in models)
    assert set(profile["ceiling"]) == {"lookup", *models}
    assert all(cell["speedup"] >= 1.0 for row in profile["ceiling"].values()
               for cell in row.values())
    # int4 matrices as block matrices, on the native kernels of this host's level
    from runtime.native import kernels

    assert card["metadata"]["product_activations"] == "int8"
    assert card["metadata"]["kernels"] == f"native-{kernels.capability()}"
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
    settings = tiny_settings(target=str(tiny_target_dir), quantize="int4", draft="none",
                             prefix_cache=False, int8_activations=False)
    card, reply = await _card_and_completion(settings)
    assert card["metadata"]["product_activations"] == "bfloat16"
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]


def test_int8_activations_setting_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_INT8_ACTIVATIONS", "false")
    assert Settings().int8_activations is False
    monkeypatch.delenv("SPECSERVE_INT8_ACTIVATIONS")
    assert Settings().int8_activations is True
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    assert settings_from_args(parser.parse_args([])).int8_activations is True
    flag = parser.parse_args(["--no-int8-activations"])
    assert settings_from_args(flag).int8_activations is False


async def _card_and_completion(settings: Settings) -> tuple[dict[str, Any], httpx.Response]:
    """The model card and a short completion from a server built from ``settings``."""
    engine = build_engine(settings)
    try:
        async with in_process(create_app(settings, engine=engine)) as c:
            (card,) = (await c.get("/v1/models")).json()["data"]
            reply = await c.post("/v1/completions", json={
                "model": TINY, "prompt": "One, two, three,", "max_tokens": 8, "temperature": 0})
        return card, reply
    finally:
        engine.shutdown()
