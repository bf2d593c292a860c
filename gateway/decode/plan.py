"""A request's plan: one validated chat or completions request (a Responses request is a
chat request underneath) turned into the engine's work, cheapest steps first.

The order is the contract: the tools are planned once (which refuses nothing: the
body's validation did); the number of choices is checked before any prompt is read; the
prompts are rendered and tokenized off the event loop, and each is checked against the
context and the limits; only then is the grammar compiled, since that may take seconds.
What comes out, a :class:`RequestPlan`, is all that running and answering the request
need to know of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from decoding.engine import Engine
from decoding.types import GenerationRequest
from gateway.decode.fim import FimTokens
from gateway.decode.grammar import request_grammar
from gateway.decode.params import (
    AnyRequest,
    Limits,
    Prompt,
    chat_prompt,
    check_choices,
    choices_per_prompt,
    completion_prompts,
    generation_requests,
    include_usage,
    logprob_options,
    operator_cap,
    predicted_tokens,
    request_seed,
)
from gateway.decode.tool_plan import ToolPlan, request_tools
from gateway.wire.requests import ChatCompletionRequest
from grammars.guidance import GrammarCompiler
from observability.telemetry import Telemetry


class PlanHost(Protocol):
    """What planning needs of the server (the gateway's state is one): its limits for
    the engine, the model's fill-in-the-middle tokens, the grammar compiler and the
    telemetry that counts structured requests."""

    telemetry: Telemetry | None
    fim: FimTokens | None

    def limits(self, engine: Engine) -> Limits: ...

    def grammar_compiler(self, engine: Engine) -> GrammarCompiler: ...


@dataclass(frozen=True)
class Job:
    """One API request as the formats need to know it."""

    id: str
    created: int
    model: str
    prompts: Sequence[Prompt]
    per_prompt: int  # choices per prompt (n)
    logprobs: bool
    echo: bool = False
    seed: int | None = None  # a sampled request's seed, reported in every body and chunk
    usage: bool = False  # stream_options.include_usage: the stream ends with a usage chunk

    def prompt_of(self, index: int) -> Prompt:
        return self.prompts[index // self.per_prompt]


@dataclass(frozen=True)
class RequestPlan:
    """A request, planned: the engine requests (one per choice, in index order, with the
    grammar attached), the job the answer is written for, and the tool plan."""

    request: AnyRequest
    job: Job
    requests: list[GenerationRequest]
    tools: ToolPlan | None  # when tools may be called
    operator_cap: int | None  # --max-tokens, where it bounds this request

    @property
    def chat(self) -> bool:
        return isinstance(self.request, ChatCompletionRequest)


async def plan_request(host: PlanHost, engine: Engine, request: AnyRequest, job_id: str,
                       model: str, *, grammar_param: str = "response_format",
                       seeded: bool = True) -> RequestPlan:
    """The plan of ``request`` on ``engine``, in the order the module describes; every
    refusal is an ``APIError``. ``seeded``: a sampled request samples with a seed, its
    own or one drawn for it, and its bodies report it (the Responses API's carry none, and
    its choices sample with the request's own seed, if any)."""
    limits = host.limits(engine)
    tokenizer = engine.target.tokenizer
    tools: ToolPlan | None = None
    if isinstance(request, ChatCompletionRequest):
        tools = request_tools(request)  # checks nothing: the body's validation did
        check_choices(request, 1, limits)
        prompts = [await asyncio.to_thread(chat_prompt, tokenizer, request, tools)]
    else:
        check_choices(request, len(request.prompt_list()), limits)
        prompts = await asyncio.to_thread(completion_prompts, tokenizer, request,
                                          engine.target.vocab_size, host.fim)
    seed = request_seed(request) if seeded else None
    requests = generation_requests(request, prompts, limits, job_id, seed)
    prediction = await asyncio.to_thread(predicted_tokens, tokenizer, request, limits)
    if prediction:
        requests = [replace(r, prediction=prediction) for r in requests]
    job = Job(id=job_id, created=int(time.time()), model=model, prompts=prompts,
              per_prompt=choices_per_prompt(request), logprobs=logprob_options(request)[0],
              echo=bool(getattr(request, "echo", False)),
              seed=None if requests[0].sampling.greedy else seed,
              usage=include_usage(request))
    cap = operator_cap(request, limits)
    grammar = await request_grammar(host, engine, request.response_format, tools, grammar_param)
    if grammar is not None:
        requests = [replace(r, grammar=grammar) for r in requests]
    return RequestPlan(request=request, job=job, requests=requests, tools=tools,
                       operator_cap=cap)
