"""Request validation and the conversion to engine requests (no model needed)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from decoding.types import SpeculationParams
from gateway.errors import InvalidRequestError
from gateway.params import (
    Limits,
    Prompt,
    SamplingDefaults,
    generation_requests,
    request_seed,
    sampling_params,
)
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.routes import parse_body

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
    ("prediction", {"type": "content", "content": "x"}),
    ("store", True),
    ("reasoning_effort", "high"),
    ("web_search_options", {}),
])
def test_unsupported_chat_fields_are_refused_by_name(field: str, value: Any) -> None:
    error = refused(ChatCompletionRequest, chat(**{field: value}))
    assert error.status_code == 400
    assert error.param == field
    assert field in error.message and error.code == "unsupported_parameter"


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
    assert refused(CompletionRequest, {"model": "m", "prompt": "x", "suffix": "y"}).param \
        == "suffix"
    assert refused(CompletionRequest, {"model": "m", "prompt": "x", "best_of": 3}).param \
        == "best_of"
    error = refused(CompletionRequest, {"model": "m", "prompt": "x", "echo": True,
                                        "logprobs": 1})
    assert "echo" in error.message and error.param == "echo"


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
    default = ChatCompletionRequest.model_validate(chat())
    assert generation_requests(default, [PROMPT], LIMITS, "i")[0].max_new_tokens == 40
    near_end = Prompt(ids=tuple(range(90)), text="")
    assert generation_requests(default, [near_end], LIMITS, "i")[0].max_new_tokens == 10
    with pytest.raises(InvalidRequestError, match="at most 40") as capped:
        generation_requests(ChatCompletionRequest.model_validate(chat(max_completion_tokens=41)),
                            [PROMPT], LIMITS, "i")
    assert capped.value.param == "max_completion_tokens"
    with pytest.raises(InvalidRequestError, match="maximum context length") as beyond:
        generation_requests(ChatCompletionRequest.model_validate(chat(max_tokens=20)),
                            [near_end], LIMITS, "i")
    assert beyond.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError, match="no room"):
        generation_requests(default, [Prompt(ids=tuple(range(100)), text="")], LIMITS, "i")
    strict = Limits(100, 2, 40, None, 1000)
    with pytest.raises(InvalidRequestError, match="at most 2"):
        generation_requests(default, [PROMPT], strict, "i")


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
