"""From a validated API request to the engine's ``GenerationRequest``s.

Everything here builds new objects; the API request is never modified. One
engine request is made per choice: ``n`` per prompt, in prompt-major order.
Every choice samples with the request's seed (drawn at random when the request
gives none, and reported back so the text can be replayed) and its own choice
index, both part of the sampling key: choices differ and each is reproducible.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from decoding.kv_budget import KvBudget
from decoding.prompting import encode_chat, encode_text
from decoding.types import GenerationRequest, SamplingParams, SpeculationParams
from gateway.decode.fim import FimTokens
from gateway.decode.tool_plan import ToolPlan, render_messages
from gateway.wire.errors import InvalidRequestError
from gateway.wire.requests import ChatCompletionRequest, CompletionRequest
from runtime.files import model_store

log = logging.getLogger(__name__)

AnyRequest = ChatCompletionRequest | CompletionRequest
SEED_MODULUS = 1 << 64


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves ``temperature``, ``top_p`` or ``top_k`` unset (or null)
    samples with; OpenAI's values unless the model or the settings say otherwise."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    source: str = "openai"  # where they come from: openai, generation_config.json, ...

    def metadata(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "source": self.source}


SAMPLING_RANGES: dict[str, tuple[type, float, float]] = {
    "temperature": (float, 0.0, 2.0), "top_p": (float, 0.0, 1.0), "top_k": (int, 0, 1 << 31)}


def sampling_problems(values: dict[str, Any]) -> list[str]:
    """What is wrong with a set of default sampling values (the ranges a request has)."""
    problems = []
    for key, value in values.items():
        if key not in SAMPLING_RANGES:
            problems.append(f"unknown key {key!r} (known: {', '.join(SAMPLING_RANGES)})")
            continue
        kind, low, high = SAMPLING_RANGES[key]
        number = (isinstance(value, int | float) and not isinstance(value, bool)
                  and math.isfinite(value))
        if not number or (kind is int and value != int(value)) or not low <= value <= high:
            problems.append(f"{key} must be {'an integer' if kind is int else 'a number'} "
                            f"from {low:g} to {high:g}, not {value!r}")
    return problems


def sampling_defaults(setting: str, model_path: str) -> SamplingDefaults:
    """The defaults ``Settings.sampling_defaults`` names for the model at ``model_path``.
    A value the model recommends outside a request's range is left out, with a warning."""
    if setting == "openai":
        return SamplingDefaults()
    if setting == "model":
        recommended, source = model_store.recommended_sampling(model_path)
        values = {}
        for key, value in recommended.items():
            problems = sampling_problems({key: value})
            if problems:
                log.warning("ignoring the model's sampling default: %s", problems[0])
            else:
                values[key] = value
        if not values:
            return SamplingDefaults(source="openai (the model recommends none)")
    else:
        values, source = json.loads(setting), "settings"
    base = SamplingDefaults()
    return SamplingDefaults(temperature=float(values.get("temperature", base.temperature)),
                            top_p=float(values.get("top_p", base.top_p)),
                            top_k=int(values.get("top_k", base.top_k)), source=source)


def model_stops(model_path: str) -> tuple[str, ...]:
    """The strings that end a chat answer for the model at ``model_path`` (the
    ``stop_strings`` of its generation_config.json), added to every chat request's."""
    return model_store.recommended_stops(model_path)


@dataclass(frozen=True)
class Limits:
    """What the server allows, from the settings and the model."""

    max_context: int
    max_prompt_tokens: int | None
    max_tokens: int | None  # the operator's cap on an answer (--max-tokens); None: none
    timeout_s: float | None
    vocab_size: int
    max_choices: int | None = None  # generations one request may ask for (prompts x n)
    kv_positions: int | None = None  # the most positions one sequence's KV holds in budget
    sampling: SamplingDefaults = SamplingDefaults()  # for fields a request leaves unset
    chat_stops: tuple[str, ...] = ()  # the model's own ends of a chat answer (its template's)


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    text: str  # what ``echo`` shows


def stop_sequences(request: AnyRequest) -> tuple[str, ...]:
    if request.stop is None:
        return ()
    stops = [request.stop] if isinstance(request.stop, str) else request.stop
    return tuple(s for s in stops if s)


def include_usage(request: AnyRequest) -> bool:
    options = request.stream_options
    return bool(request.stream and options is not None and options.include_usage)


def choices_per_prompt(request: AnyRequest) -> int:
    return request.n or 1


def request_seed(request: AnyRequest) -> int:
    """The seed a request samples with: its own, or one drawn now (to report back)."""
    return secrets.randbits(63) if request.seed is None else request.seed


def sampling_params(request: AnyRequest, choice: int = 0, seed: int | None = None,
                    defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """``seed``: the request's (``request_seed``); None: the request's own, if any.
    ``defaults`` fill the sampling fields the request leaves unset."""
    temperature = defaults.temperature if request.temperature is None else request.temperature
    top_p = defaults.top_p if request.top_p is None else request.top_p
    if top_p == 0.0:  # the limit of top-p sampling: only the most likely token
        temperature, top_p = 0.0, 1.0
    seed = request.seed if seed is None else seed
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=defaults.top_k if request.top_k is None else request.top_k,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        seed=None if seed is None else seed % SEED_MODULUS,
        choice=choice,
    )


def speculation_params(request: AnyRequest) -> SpeculationParams:
    options = request.speculation
    if options is None:
        return SpeculationParams()
    return SpeculationParams(enabled=options.enabled, drafter=options.drafter,
                             max_draft_tokens=options.max_draft_tokens)


def logprob_options(request: AnyRequest) -> tuple[bool, int]:
    """Whether to return logprobs, and how many alternatives per token."""
    if isinstance(request, ChatCompletionRequest):
        return bool(request.logprobs), request.top_logprobs or 0
    if request.logprobs is None:
        return False, 0
    return True, request.logprobs


# -- prompts --------------------------------------------------------------------------


def chat_prompt(tokenizer: Any, request: ChatCompletionRequest, plan: ToolPlan | None
                ) -> Prompt:
    """The conversation as the chat template renders it, with the tools of ``plan``
    (``request_tools``)."""
    messages, tools = render_messages(request.messages, plan, tokenizer)
    try:
        ids = encode_chat(tokenizer, messages, tools)
    except Exception as exc:  # a template that refuses the conversation (role order, ...)
        raise InvalidRequestError(f"The messages could not be formatted: {exc}",
                                  param="messages") from exc
    return Prompt(ids=tuple(ids), text="")


def completion_prompts(tokenizer: Any, request: CompletionRequest, vocab_size: int,
                       fim: FimTokens | None = None) -> list[Prompt]:
    """The request's prompts as token ids; with a ``suffix``, each as the prefix of a
    fill-in-the-middle prompt in the model's format (``fim``; a 400 without one)."""
    if request.suffix and fim is None:
        raise InvalidRequestError(
            "suffix (fill-in-the-middle) needs a model whose vocabulary has fill-in-the-"
            "middle tokens; this model has none.", param="suffix", code="invalid_value")
    after = encode_text(tokenizer, request.suffix) if request.suffix else None
    prompts = []
    for i, item in enumerate(request.prompt_list()):
        if isinstance(item, str):
            ids, text = tuple(encode_text(tokenizer, item)), item
        else:
            bad = next((t for t in item if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"Token id {bad} is outside the vocabulary (0..{vocab_size - 1}).",
                    param=f"prompt[{i}]", code="invalid_value")
            ids = tuple(item)
            text = str(tokenizer.decode(item, skip_special_tokens=False,
                                        clean_up_tokenization_spaces=False))
        if fim is not None and after is not None:
            ids = fim.prompt(ids, after)
        prompts.append(Prompt(ids=ids, text=text))
    return prompts


# -- limits ---------------------------------------------------------------------------


def check_prompt(prompt: Prompt, limits: Limits, param: str) -> None:
    size = len(prompt.ids)
    if size == 0:
        raise InvalidRequestError("The prompt is empty: it must contain at least one token.",
                                  param=param, code="invalid_value")
    if limits.max_prompt_tokens is not None and size > limits.max_prompt_tokens:
        raise InvalidRequestError(
            f"The prompt has {size} tokens; this server accepts at most "
            f"{limits.max_prompt_tokens}.", param=param, code="context_length_exceeded")
    if size >= limits.max_context:
        raise InvalidRequestError(
            f"This model's maximum context length is {limits.max_context} tokens, and the "
            f"prompt has {size}: no room is left to generate.",
            param=param, code="context_length_exceeded")


def check_choices(request: AnyRequest, prompts: int, limits: Limits) -> None:
    """More generations than the engine can queue at once could never be admitted:
    a 400, not a 429 that no retry would cure."""
    count = prompts * choices_per_prompt(request)
    if limits.max_choices is not None and count > limits.max_choices:
        raise InvalidRequestError(
            f"The request asks for {count} generations ({prompts} prompt(s) x n = "
            f"{choices_per_prompt(request)}); this server accepts at most "
            f"{limits.max_choices} per request.",
            param="n" if choices_per_prompt(request) > 1 else "prompt", code="invalid_value")


def max_new_tokens(request: AnyRequest, prompt_len: int, limits: Limits) -> int:
    """The most tokens the answer to a prompt of ``prompt_len`` may have: what the request
    asks for, else the room left in the context (and in the KV budget where the prompt
    leaves room in it: a longer prompt runs alone, as the engine admits it), either
    bounded by the operator's cap."""
    asked, field = request.requested_max_tokens()
    room = limits.max_context - prompt_len
    if asked is not None and asked > room:
        raise InvalidRequestError(
            f"This model's maximum context length is {limits.max_context} tokens. However, "
            f"you requested {prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} "
            f"in the completion).", param=field, code="context_length_exceeded")
    if asked is None:
        budget_room = (limits.kv_positions - prompt_len - 1
                       if limits.kv_positions is not None else room)
        asked = min(room, budget_room) if budget_room >= 1 else room
    return min(asked, limits.max_tokens) if limits.max_tokens is not None else asked


def operator_cap(request: AnyRequest, limits: Limits) -> int | None:
    """The operator's cap where it is below what the request asks (or the request sets no
    limit): an answer of that many tokens that ends in ``length`` was cut by it."""
    asked, _ = request.requested_max_tokens()
    cap = limits.max_tokens
    return cap if cap is not None and (asked is None or asked > cap) else None


def budget_positions(budget: KvBudget) -> int | None:
    """The most positions one sequence alone may hold in the engine's pool of KV blocks
    (None: the pool has no bound, or holds the whole context)."""
    positions = budget.positions()
    return None if positions is None or positions > budget.target.max_context else positions


def predicted_tokens(tokenizer: Any, request: AnyRequest, limits: Limits) -> tuple[int, ...]:
    """The request's prediction as token ids (none without one), refused where it is
    longer than the model's context: no answer could follow that much of it."""
    if request.prediction is None:
        return ()
    ids = tuple(encode_text(tokenizer, request.prediction.text()))
    if len(ids) > limits.max_context:
        raise InvalidRequestError(
            f"The prediction has {len(ids)} tokens; this model's maximum context length is "
            f"{limits.max_context} tokens.", param="prediction", code="context_length_exceeded")
    return ids


def generation_requests(
    request: AnyRequest, prompts: Sequence[Prompt], limits: Limits, request_id: str,
    seed: int | None = None,
) -> list[GenerationRequest]:
    """One engine request per choice, in choice-index order, sampling with ``seed``
    (``request_seed``; None: the request's own); each prompt checked against the limits
    (the number of choices is checked before the prompts are read: ``check_choices``)."""
    chat = isinstance(request, ChatCompletionRequest)
    param = "messages" if chat else "prompt"
    logprobs, top_logprobs = logprob_options(request)
    prompt_logprobs = isinstance(request, CompletionRequest) and request.prompt_logprobs
    speculation = speculation_params(request)
    stops = stop_sequences(request)
    if chat:
        stops = tuple(dict.fromkeys((*stops, *limits.chat_stops)))
    out: list[GenerationRequest] = []
    for p, prompt in enumerate(prompts):
        check_prompt(prompt, limits, param if len(prompts) == 1 else f"{param}[{p}]")
        new_tokens = max_new_tokens(request, len(prompt.ids), limits)
        for j in range(choices_per_prompt(request)):
            out.append(GenerationRequest(
                prompt_ids=prompt.ids,
                max_new_tokens=new_tokens,
                sampling=sampling_params(request, j, seed, limits.sampling),
                stop=stops,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                speculation=speculation,
                timeout_s=limits.timeout_s,
                request_id=f"{request_id}-{len(out)}",
                prompt_logprobs=prompt_logprobs,
            ))
    return out
