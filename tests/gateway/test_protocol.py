"""Request validation and the conversion to engine requests (no model needed)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import pytest

from decoding.kv_budget import KvBudget
from decoding.types import SpeculationParams
from gateway.api.intake import parse_body
from gateway.api.openapi import REQUEST_MODELS
from gateway.decode.params import (
    Limits,
    Prompt,
    SamplingDefaults,
    budget_positions,
    generation_requests,
    operator_cap,
    request_seed,
    sampling_params,
)
from gateway.server import create_app
from gateway.wire.errors import InvalidRequestError
from gateway.wire.requests import ChatCompletionRequest, CompletionRequest
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import BLOCK
from tests.gateway.conftest import tiny_settings

LIMITS = Limits(max_context=100, max_prompt_tokens=None, max_tokens=40, timeout_s=5.0,
                vocab_size=1000)
PROMPT = Prompt(ids=(1, 2, 3), text="abc")


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def refused(model: type[Any], payload: dict[str, Any]) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        parse_body(model, json.dumps(payload).encode())
    return info.value


@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("logit_bias", {"42": 5}),
    ("audio", {"voice": "alloy", "format": "mp3"}),
    ("modalities", ["text", "audio"]),
    ("store", True),
    ("reasoning_effort", "high"),
    ("web_search_options", {}),
])
def test_unsupported_chat_fields_are_refused_by_name(field: str, value: Any) -> None:
    error = refused(ChatCompletionRequest, chat(**{field: value}))
    assert error.status_code == 400
    assert error.param == field
    assert field in error.message and error.code == "unsupported_parameter"


@pytest.mark.parametrize(("prediction", "param"), [
    ({"type": "text", "content": "x"}, "prediction.type"),
    ({"content": "x"}, "prediction.type"),
    ({"type": "content"}, "prediction.content"),
    ({"type": "content", "content": ""}, "prediction.content"),
    ({"type": "content", "content": []}, "prediction.content"),
    ({"type": "content", "content": [{"type": "text", "text": ""}]}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "prediction.content"),
    ({"type": "content", "content": [{"type": "text"}]}, "prediction.content"),
    ({"type": "content", "content": 5}, "prediction.content"),
    ("def f(): pass", "prediction"),
])
def test_a_bad_prediction_is_refused_naming_the_field(prediction: Any, param: str) -> None:
    for model, body in ((ChatCompletionRequest, chat(prediction=prediction)),
                        (CompletionRequest, {"model": "m", "prompt": "p",
                                             "prediction": prediction})):
        error = refused(model, body)
        assert error.status_code == 400
        assert error.param is not None and error.param.startswith(param), (error.param, param)


def test_a_prediction_is_a_string_or_text_parts() -> None:
    whole = parse_body(ChatCompletionRequest, json.dumps(chat(
        prediction={"type": "content", "content": "def f():\n    return 1\n"})).encode())
    parts = parse_body(ChatCompletionRequest, json.dumps(chat(prediction={
        "type": "content", "content": [{"type": "text", "text": "def f():\n"},
                                       {"type": "text", "text": "    return 1\n"}]})).encode())
    assert whole.prediction is not None and parts.prediction is not None
    assert whole.prediction.text() == parts.prediction.text() == "def f():\n    return 1\n"


def test_neutral_values_of_unsupported_fields_pass() -> None:
    request = parse_body(ChatCompletionRequest, json.dumps(chat(
        tools=[], tool_choice="none", response_format={"type": "text"}, logit_bias={},
        functions=None, store=False, modalities=["text"], service_tier="auto",
    )).encode())
    assert request.tools == [] and request.logit_bias is None and request.store is None


def test_unknown_fields_are_refused_by_name() -> None:
    error = refused(ChatCompletionRequest, chat(frobnicate=1))
    assert error.param == "frobnicate"
    assert "Unrecognized request argument supplied: frobnicate" in error.message
    nested = refused(ChatCompletionRequest, chat(speculation={"enabled": True, "k": 3}))
    assert nested.param == "speculation.k"


def test_content_parts() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    request = parse_body(ChatCompletionRequest, json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": parts}]}).encode())
    assert request.messages[0].text() == "one\ntwo"
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    error = refused(ChatCompletionRequest,
                    {"model": "m", "messages": [{"role": "user", "content": image}]})
    assert error.param == "messages[0].content" and "image_url" in error.message


def test_message_fields() -> None:
    assert refused(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": "x", "name": "bob"}]}).param == "messages[0].name"
    assert refused(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "tool", "content": "x"}]}).param == "messages[0]"  # no tool_call_id
    assert refused(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": None}]}).param == "messages[0]"
    assert refused(ChatCompletionRequest, {"model": "m", "messages": []}).param == "messages"
    # An assistant message echoed back from an earlier response is fine.
    request = parse_body(ChatCompletionRequest, json.dumps({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y", "refusal": None, "tool_calls": None},
    ]}).encode())
    assert request.messages[0].template_role() == "system"


@pytest.mark.parametrize(("payload", "param"), [
    (chat(temperature=3), "temperature"),
    (chat(n=0), "n"),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (chat(stop=["a", 7]), "stop[1]"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text"),
    (chat(top_logprobs=3), "top_logprobs"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    (chat(max_tokens=5, max_completion_tokens=6), "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
])
def test_invalid_values(payload: dict[str, Any], param: str | None) -> None:
    error = refused(ChatCompletionRequest, payload)
    assert error.status_code == 400 and error.param == param


def test_body_must_be_a_json_object() -> None:
    for body in (b"{not json", b"[1, 2]"):
        with pytest.raises(InvalidRequestError, match="JSON"):
            parse_body(ChatCompletionRequest, body)


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_prompt_forms(prompt: Any) -> None:
    request = parse_body(CompletionRequest, json.dumps({"model": "m", "prompt": prompt}).encode())
    expected = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    assert request.prompt_list() == expected


@pytest.mark.parametrize("prompt", [["a", 1], [], [[1], []], [True, 2]])
def test_bad_prompts(prompt: Any) -> None:
    assert refused(CompletionRequest, {"model": "m", "prompt": prompt}).param == "prompt"


def test_completion_refusals() -> None:
    assert refused(CompletionRequest, {"model": "m", "prompt": "x", "suffix": "y",
                                       "echo": True}).param == "echo"
    assert refused(CompletionRequest, {"model": "m", "prompt": "x", "best_of": 3}).param \
        == "best_of"
    error = refused(CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": 0})
    assert "echo" in error.message and error.param == "max_tokens"
    assert refused(CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": -1}).param \
        == "max_tokens"


@pytest.mark.parametrize(("body", "scored"), [
    ({"echo": True, "logprobs": 1, "max_tokens": 0}, True),
    ({"echo": True, "logprobs": 0}, True),
    ({"echo": True, "max_tokens": 0.0}, False),
    ({"logprobs": 3}, False),
])
def test_prompt_logprobs_come_with_echo_and_logprobs(body: dict[str, Any], scored: bool
                                                     ) -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": [5, 6, 7], **body})
    assert request.prompt_logprobs is scored
    out = generation_requests(request, [PROMPT], LIMITS, "id")
    assert out[0].prompt_logprobs is scored
    assert (out[0].max_new_tokens == 0) is (body.get("max_tokens") == 0)


def test_conversion_makes_new_objects_and_seeds_choices() -> None:
    request = ChatCompletionRequest.model_validate(chat(
        n=3, seed=41, temperature=0.7, top_p=0.9, top_k=5, stop="END", logprobs=True,
        top_logprobs=2, max_tokens=7, presence_penalty=0.5,
        speculation={"drafter": "draft", "max_draft_tokens": 3}))
    before = request.model_dump()
    out = generation_requests(request, [PROMPT], LIMITS, "id")
    assert request.model_dump() == before
    assert [(r.sampling.seed, r.sampling.choice) for r in out] == [(41, 0), (41, 1), (41, 2)]
    first = out[0]
    assert first.prompt_ids == (1, 2, 3) and first.max_new_tokens == 7
    assert (first.sampling.temperature, first.sampling.top_p, first.sampling.top_k) \
        == (0.7, 0.9, 5)
    assert first.sampling.presence_penalty == 0.5 and first.stop == ("END",)
    assert first.logprobs and first.top_logprobs == 2 and first.timeout_s == 5.0
    assert first.speculation == SpeculationParams(True, "draft", 3)
    assert len({r.request_id for r in out}) == 3


def test_choices_are_prompt_major() -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "n": 2,
                                                "seed": 1})
    prompts = [PROMPT, Prompt(ids=(9,), text="b")]
    out = generation_requests(request, prompts, LIMITS, "id")
    assert [r.prompt_ids for r in out] == [(1, 2, 3), (1, 2, 3), (9,), (9,)]
    assert [(r.sampling.seed, r.sampling.choice) for r in out] == [(1, 0), (1, 1), (1, 0), (1, 1)]


def test_an_unseeded_request_samples_with_the_seed_it_is_given() -> None:
    request = ChatCompletionRequest.model_validate(chat(n=2, temperature=0.8))
    drawn = request_seed(request)
    again = request_seed(request)
    assert drawn != again  # drawn afresh for each request
    out = generation_requests(request, [PROMPT], LIMITS, "id", seed=drawn)
    assert [(r.sampling.seed, r.sampling.choice) for r in out] == [(drawn, 0), (drawn, 1)]
    negative = ChatCompletionRequest.model_validate(chat(seed=-5))
    assert request_seed(negative) == -5
    assert sampling_params(negative, 0, -5).seed == (1 << 64) - 5


def test_top_p_zero_is_greedy() -> None:
    assert sampling_params(ChatCompletionRequest.model_validate(chat(top_p=0))).greedy


def test_token_limits() -> None:
    """Without max_tokens an answer may fill the context; the operator's cap bounds what
    a request asks for, or the room it would have, and is reported as binding."""
    default = ChatCompletionRequest.model_validate(chat())
    uncapped = dataclasses.replace(LIMITS, max_tokens=None)
    assert generation_requests(default, [PROMPT], uncapped, "i")[0].max_new_tokens == 97
    assert operator_cap(default, uncapped) is None
    assert generation_requests(default, [PROMPT], LIMITS, "i")[0].max_new_tokens == 40
    assert operator_cap(default, LIMITS) == 40
    near_end = Prompt(ids=tuple(range(90)), text="")
    assert generation_requests(default, [near_end], LIMITS, "i")[0].max_new_tokens == 10
    more = ChatCompletionRequest.model_validate(chat(max_completion_tokens=41))
    assert generation_requests(more, [PROMPT], LIMITS, "i")[0].max_new_tokens == 40
    assert operator_cap(more, LIMITS) == 40
    exact = ChatCompletionRequest.model_validate(chat(max_tokens=40))
    assert operator_cap(exact, LIMITS) is None  # the request's own limit, not the cap
    with pytest.raises(InvalidRequestError, match="maximum context length") as beyond:
        generation_requests(ChatCompletionRequest.model_validate(chat(max_tokens=20)),
                            [near_end], LIMITS, "i")
    assert beyond.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError, match="no room"):
        generation_requests(default, [Prompt(ids=tuple(range(100)), text="")], LIMITS, "i")
    strict = Limits(100, 2, 40, None, 1000)
    with pytest.raises(InvalidRequestError, match="at most 2"):
        generation_requests(default, [PROMPT], strict, "i")


def test_a_kv_budget_bounds_an_answer_without_max_tokens() -> None:
    """Where the KV budget holds fewer positions than the context, an answer without a
    limit stops within it; a prompt that alone passes it runs to the context's end."""
    budget = dataclasses.replace(LIMITS, max_tokens=None, kv_positions=50)
    default = ChatCompletionRequest.model_validate(chat())
    assert generation_requests(default, [PROMPT], budget, "i")[0].max_new_tokens == 46
    long = Prompt(ids=tuple(range(60)), text="")
    assert generation_requests(default, [long], budget, "i")[0].max_new_tokens == 40
    asked = ChatCompletionRequest.model_validate(chat(max_tokens=90))
    assert generation_requests(asked, [PROMPT], budget, "i")[0].max_new_tokens == 90


def test_budget_positions_are_the_pool_s_blocks(tiny_target: CausalLM) -> None:
    """The positions one sequence may hold: all of the context under a large budget (or
    none), and the pool's whole blocks under a small one."""
    try:
        tiny_target.set_kv_budget(None)
        assert budget_positions(KvBudget(tiny_target, None)) is None
        tiny_target.set_kv_budget(1 << 40)
        assert budget_positions(KvBudget(tiny_target, 1 << 40)) is None
        small = 5 * tiny_target.kv_block_bytes + 1  # five blocks, and a byte of a sixth
        tiny_target.set_kv_budget(small)
        assert budget_positions(KvBudget(tiny_target, small)) == 5 * BLOCK
    finally:
        tiny_target.set_kv_budget(None)


@pytest.mark.parametrize(("model", "payload", "field", "value"), [
    (ChatCompletionRequest, chat(max_tokens=16.0), "max_tokens", 16),
    (ChatCompletionRequest, chat(max_completion_tokens=8.0), "max_completion_tokens", 8),
    (ChatCompletionRequest, chat(n=2.0, seed=-3.0), "n", 2),
    (ChatCompletionRequest, chat(top_k=11966.0), "top_k", 11966),
    (ChatCompletionRequest, chat(logprobs=True, top_logprobs=2.0), "top_logprobs", 2),
    (CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 1.0}, "logprobs", 1),
    (CompletionRequest, {"model": "m", "prompt": [1.0, 2]}, "prompt", [1, 2]),
    (CompletionRequest, {"model": "m", "prompt": [[3.0], [4]]}, "prompt", [[3], [4]]),
])
def test_integral_floats_are_integers(model: type[Any], payload: dict[str, Any], field: str,
                                      value: Any) -> None:
    """JSON Schema's ``integer`` (the published schema) includes 16.0, and so does OpenAI."""
    request = parse_body(model, json.dumps(payload).encode())
    got = getattr(request, field)
    assert json.dumps(got) == json.dumps(value)  # 16, not 16.0


# a valid body of each endpoint, and what an integer field needs beside it to be valid
VALID_BODIES = {"ChatCompletionRequest": chat(),
                "CompletionRequest": {"model": "m", "prompt": "x"},
                "ResponsesRequest": {"model": "m", "input": "x"}}
NEEDS = {"top_logprobs": {"logprobs": True}}


def integer_fields(document: dict[str, Any]) -> Iterator[tuple[str, tuple[str, ...],
                                                                dict[str, Any]]]:
    """Every integer field of every endpoint's request body in the published schema:
    (the body's schema name, the field's path, the integer's schema with its bounds).
    Objects are walked into through references; arrays are not (token-id prompts have
    their own cases above)."""
    components = document["components"]["schemas"]

    def walk(schema: dict[str, Any], path: tuple[str, ...], seen: frozenset[str]
             ) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
        ref = schema.get("$ref")
        if ref is not None:
            name = ref.rsplit("/", 1)[1]
            if name not in seen:
                yield from walk(components[name], path, seen | {name})
            return
        if schema.get("type") == "integer" and path:
            yield path, schema
        for option in schema.get("anyOf", ()):
            yield from walk(option, path, seen)
        for key, value in schema.get("properties", {}).items():
            yield from walk(value, (*path, key), seen)

    for operations in document["paths"].values():
        for operation in operations.values():
            if "requestBody" not in operation:
                continue
            body = operation["requestBody"]["content"]["application/json"]["schema"]
            for option in body.get("anyOf", [body]):  # a body of several kinds: each
                name = option["$ref"].rsplit("/", 1)[1]
                for path, schema in walk(components[name], (), frozenset({name})):
                    yield name, path, schema


def _with(body: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(body))
    node = out
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return out


def test_every_integer_field_of_every_endpoint_takes_integral_floats() -> None:
    """Each integer field of each request body, enumerated from the published schema (a
    new field or endpoint is covered without a new case): the schema (under a JSON Schema
    validator) and the server both take an integral float and refuse a fractional one,
    and the server reads the integral float as that integer."""
    document = create_app(tiny_settings()).openapi()
    models = {model.__name__: model for model in REQUEST_MODELS}
    fields = list(integer_fields(document))
    names = {(name, ".".join(path)) for name, path, _ in fields}
    assert {("ResponsesRequest", "max_output_tokens"), ("ChatCompletionRequest", "max_tokens"),
            ("CompletionRequest", "seed"), ("ChatCompletionRequest",
                                            "speculation.max_draft_tokens")} <= names
    assert {name for name, _ in names} == set(VALID_BODIES)  # every endpoint's body
    for name, path, schema in fields:
        check = jsonschema_rs.Draft202012Validator(
            {"$ref": f"#/components/schemas/{name}", "components": document["components"]})
        value = min(max(16, schema.get("minimum", 16)), schema.get("maximum", 16))
        fraction = value + 0.5 if value + 0.5 <= schema.get("maximum", value + 1) else value - 0.5
        base = {**VALID_BODIES[name], **NEEDS.get(path[-1], {})}
        whole = _with(base, path, float(value))
        assert check.is_valid(whole), (name, path)
        parsed: Any = parse_body(models[name], json.dumps(whole).encode())
        for key in path:
            parsed = getattr(parsed, key)
        assert type(parsed) is int and parsed == value, (name, path, parsed)
        half = _with(base, path, fraction)
        assert not check.is_valid(half), (name, path)
        assert refused(models[name], half).param == ".".join(path)


@pytest.mark.parametrize(("payload", "param"), [
    (chat(max_tokens=16.5), "max_tokens"),
    (chat(n=True), "n"),
    (chat(max_tokens="16"), "max_tokens"),
    (chat(seed=float("inf")), "seed"),
])
def test_fractional_floats_and_other_types_stay_refused(payload: dict[str, Any],
                                                        param: str) -> None:
    body = json.dumps(payload, allow_nan=True).encode()
    with pytest.raises(InvalidRequestError) as info:
        parse_body(ChatCompletionRequest, body)
    assert info.value.param == param


def test_top_logprobs_needs_logprobs_as_openai_says() -> None:
    error = refused(ChatCompletionRequest, chat(top_logprobs=2))
    assert error.param == "top_logprobs" and "only allowed when 'logprobs'" in error.message
    refused(ChatCompletionRequest, chat(top_logprobs=2, logprobs=False))
    assert parse_body(ChatCompletionRequest, json.dumps(chat(top_logprobs=0)).encode())


def test_unset_sampling_fields_take_the_defaults_and_set_ones_win() -> None:
    defaults = SamplingDefaults(temperature=0.2, top_p=0.9, top_k=40, source="model card")
    limits = dataclasses.replace(LIMITS, sampling=defaults)
    unset = generation_requests(ChatCompletionRequest.model_validate(chat()), [PROMPT],
                                limits, "i")[0].sampling
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.2, 0.9, 40)
    null = ChatCompletionRequest.model_validate(chat(temperature=None, top_p=None))
    assert sampling_params(null, defaults=defaults).temperature == 0.2
    own = ChatCompletionRequest.model_validate(chat(temperature=1.0, top_p=1.0, top_k=0))
    mine = generation_requests(own, [PROMPT], limits, "i")[0].sampling
    assert (mine.temperature, mine.top_p, mine.top_k) == (1.0, 1.0, 0)
    mixed = sampling_params(ChatCompletionRequest.model_validate(chat(temperature=0.7)),
                            defaults=defaults)
    assert (mixed.temperature, mixed.top_p) == (0.7, 0.9)
    openai = sampling_params(ChatCompletionRequest.model_validate(chat()))
    assert (openai.temperature, openai.top_p, openai.top_k) == (1.0, 1.0, 0)
    greedy = sampling_params(ChatCompletionRequest.model_validate(chat(temperature=0)),
                             defaults=defaults)
    assert greedy.greedy


def test_the_models_stop_strings_end_chat_answers_only() -> None:
    """A model's ``stop_strings`` (its generation_config.json) are added to a chat
    request's own, once each; a completion's prompt has no template, so none apply."""
    limits = dataclasses.replace(LIMITS, chat_stops=("\nUser:", "\nAssistant:"))
    request = ChatCompletionRequest.model_validate(chat(stop=["\nUser:", "END"]))
    assert generation_requests(request, [PROMPT], limits, "i")[0].stop == (
        "\nUser:", "END", "\nAssistant:")
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    assert generation_requests(completion, [PROMPT], limits, "i")[0].stop == ()
