"""Predicted outputs over HTTP, through the official ``openai`` client, on the real
default model: ``prediction`` changes no text, streamed or not, with several choices,
log-probabilities or tools; ``usage.completion_tokens_details`` counts a prediction
of known overlap exactly; the rounds it drafts are named ``prediction`` in the
stream's figures and in the metrics; a bad prediction is a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from decoding.engine import Engine
from decoding.prompting import encode_text
from drafters.ngram import NgramDrafter
from drafters.prediction import PredictionDrafter
from gateway.server import create_app
from gateway.service.settings import Settings
from observability.telemetry import Telemetry
from runtime.runner.causal_lm import CausalLM
from tests.gateway.conftest import live_server, metric_total, openai_client

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
CODE = '''def area(width, height):
    result = width * height
    return result
'''
MESSAGES: list[Any] = [{"role": "user", "content": "Rename the variable result to product in this "
             f"Python function and answer with the whole function.\n\n```python\n{CODE}```"}]
UNRELATED = "The weather in the mountains changes quickly; bring a coat and a map.\n"


@pytest.fixture(scope="module")
def telemetry() -> Telemetry:
    return Telemetry(MODEL)


@pytest.fixture(scope="module")
def url(default_target: CausalLM, telemetry: Telemetry) -> Iterator[str]:
    engine = Engine(default_target, {"ngram": NgramDrafter()}, default_drafter="ngram",
                    predicted=PredictionDrafter.around)
    engine.start()
    try:
        with live_server(create_app(Settings(api_keys=[], cors_origins=[]), engine=engine,
                                    telemetry=telemetry)) as served:
            yield served
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai_client(url)


def _ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 64)
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                          **kwargs)


def _prediction(text: str) -> dict[str, Any]:
    return {"type": "content", "content": text}


def test_usage_counts_a_prediction_of_known_overlap(
        client: openai.OpenAI, default_target: CausalLM) -> None:
    plain = _ask(client)
    answer = plain.choices[0].message.content
    answer_ids = encode_text(default_target.tokenizer, answer)
    ended = 1 if plain.choices[0].finish_reason == "stop" else 0  # the end-of-turn token
    assert len(answer_ids) + ended == plain.usage.completion_tokens  # it re-tokenizes alike
    details = plain.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)

    exact = _ask(client, prediction=_prediction(answer))
    assert exact.choices[0].message.content == answer
    details = exact.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == len(answer_ids)
    assert details.rejected_prediction_tokens == 0
    assert exact.usage.completion_tokens == len(answer_ids) + ended

    # the answer followed by a sentence of its own: those tokens are rejected, and counted
    # as completion tokens, as OpenAI counts them
    extra_ids = encode_text(default_target.tokenizer, "\n\n" + UNRELATED)
    longer = _ask(client, prediction=_prediction(answer + "\n\n" + UNRELATED))
    predicted = len(encode_text(default_target.tokenizer, answer + "\n\n" + UNRELATED))
    assert predicted == len(answer_ids) + len(extra_ids)  # the join splits no token
    details = longer.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == len(answer_ids)
    assert details.rejected_prediction_tokens == len(extra_ids)
    assert longer.usage.completion_tokens == len(answer_ids) + ended + len(extra_ids)
    assert longer.usage.total_tokens == longer.usage.prompt_tokens + (
        longer.usage.completion_tokens)
    assert longer.choices[0].message.content == answer


def test_a_streamed_answer_with_a_prediction(client: openai.OpenAI, telemetry: Telemetry
                                             ) -> None:
    whole = _ask(client)
    answer = whole.choices[0].message.content
    before = metric_total(telemetry.metrics, "specserve_spec_decode_num_draft_tokens_total",
                          drafter="prediction")
    chunks = list(_ask(client, stream=True, stream_options={"include_usage": True},
                       prediction=_prediction(CODE.replace("result", "product"))))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert usage.completion_tokens == whole.usage.completion_tokens + (
        details.rejected_prediction_tokens)
    rounds = [c.model_extra["speculation"]["round"] for c in chunks
              if c.model_extra.get("speculation", {}).get("round")]
    assert any(r["source"] == "prediction" and r["accepted_tokens"] > 0 for r in rounds), [
        (r["source"], r["draft_tokens"], r["accepted_tokens"]) for r in rounds]
    assert any(origin == "prediction" for r in rounds for _, origin in r["spans"])
    after = metric_total(telemetry.metrics, "specserve_spec_decode_num_draft_tokens_total",
                         drafter="prediction")
    assert after > before


def test_choices_logprobs_and_tools_are_served_with_a_prediction(
        client: openai.OpenAI) -> None:
    """OpenAI refuses these beside a prediction; here each is exact, so each is served."""
    prediction: Any = _prediction(CODE.replace("result", "product"))
    kwargs: dict[str, Any] = {"n": 2, "seed": 4, "temperature": 0.8, "logprobs": True,
                              "top_logprobs": 2, "max_tokens": 32}
    without = client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
    with_it = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                             prediction=prediction, **kwargs)
    for a, b in zip(without.choices, with_it.choices, strict=True):
        assert a.message.content == b.message.content
        assert a.logprobs is not None and b.logprobs is not None
        assert [t.logprob for t in a.logprobs.content or []] == [
            t.logprob for t in b.logprobs.content or []] != []
    tools = [{"type": "function", "function": {"name": "save", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]
    plain = _ask(client, tools=tools, tool_choice="required", max_tokens=48)
    predicted = _ask(client, tools=tools, tool_choice="required", max_tokens=48,
                     prediction=prediction)
    calls = [[(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
             for r in (plain, predicted)]
    assert calls[0] == calls[1] and calls[0]


def test_completions_take_a_prediction_too(url: str) -> None:
    body = {"model": MODEL, "prompt": "def add(a, b):\n", "max_tokens": 24, "temperature": 0}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    text = plain["choices"][0]["text"]
    again = httpx.post(f"{url}/v1/completions", json={
        **body, "prediction": _prediction(text)}, timeout=120).json()
    assert again["choices"][0]["text"] == text
    assert again["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0


@pytest.mark.parametrize(("prediction", "param"), [
    ({"type": "content", "content": ""}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "prediction.content[0].type"),
    ({"type": "contents", "content": "x"}, "prediction.type"),
    ({"type": "content", "content": "word " * 9000}, "prediction"),
])
def test_a_bad_prediction_is_a_400_naming_the_field(
        client: openai.OpenAI, prediction: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, prediction=prediction)
    assert info.value.status_code == 400
    body: Any = info.value.body
    assert body["param"] == param
