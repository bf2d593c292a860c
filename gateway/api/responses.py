"""``POST /v1/responses``: the Responses API, stateless, on the chat pipeline.

The request becomes a chat request (gateway/wire/responses.py); its answer
comes back as ``output`` items: a ``message`` with ``output_text``, or
``function_call`` items. Streamed, the typed events the SDKs parse:
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` or
``response.function_call_arguments.delta``, their ``.done`` events,
``response.output_item.done``, then ``response.completed`` (``response.incomplete``
when max_output_tokens cut the answer, ``response.failed`` on an error).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from decoding.types import FinishReason, RoundEvent, SamplingParams
from gateway.api.intake import gateway_state, parse_request, require_api_key
from gateway.api.openapi import responses_route
from gateway.decode.grammar import request_grammar
from gateway.decode.params import (
    chat_prompt,
    check_choices,
    generation_requests,
    operator_cap,
    with_grammar,
)
from gateway.decode.tool_plan import ToolPlan, request_tools
from gateway.encode.formats import Job
from gateway.encode.tool_calls import CallParser
from gateway.encode.totals import ChoiceTotals, usage_of
from gateway.predict.run import Idle, ResponseRun, request_trace
from gateway.wire.errors import APIError, from_validation_errors
from gateway.wire.responses import ResponsesRequest

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


def _item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


class ResponseBody(BaseModel):
    """The Response object, as built below (serialised as it is)."""

    model_config = ConfigDict(extra="allow")


class ResponsesFormat:
    """Builds the Response object and, streamed, its events (one choice)."""

    def __init__(self, job: Job, api: ResponsesRequest, plan: ToolPlan | None,
                 sampling: SamplingParams) -> None:
        self.job = job
        self.api = api
        self.sampling = sampling  # what the response reports it sampled with
        self.parser = CallParser.of(plan) if plan is not None else None
        self.names = api.function_names()
        self.items: list[dict[str, Any]] = []  # output items, as they stand
        self.text_item: dict[str, Any] | None = None
        self.sequence = 0

    # -- the Response object ------------------------------------------------------------

    def body(self, status: str, totals: ChoiceTotals | None) -> dict[str, Any]:
        api = self.api
        usage = None
        if totals is not None:
            u = usage_of([totals], 1)
            usage = {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
                     "total_tokens": u.total_tokens,
                     "input_tokens_details": {"cached_tokens": totals.cached_tokens},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        fmt = api.text.format if api.text is not None and api.text.format else None
        reasoning = api.reasoning
        return {
            "id": self.job.id, "object": "response", "created_at": self.job.created,
            "status": status, "error": None, "model": self.job.model,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": api.instructions, "max_output_tokens": api.max_output_tokens,
            "output": self.items, "parallel_tool_calls": api.parallel_tool_calls is not False,
            "previous_response_id": None, "store": False,
            "temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                     if fmt else {"type": "text"}},
            "tool_choice": api.tool_choice if isinstance(api.tool_choice, str) or
            api.tool_choice is None else api.tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in api.tools or ()],
            "usage": usage, "metadata": dict(api.metadata or {}),
            "prompt_cache_key": api.prompt_cache_key,
            "reasoning": {"effort": reasoning.effort if reasoning else None,
                          "summary": (reasoning.summary or reasoning.generate_summary)
                          if reasoning else None},
            "speculation": totals.stats().model_dump() if totals is not None else None,
            "ignored_tools": api.hosted_tools(),
        }

    # -- the ``Format`` protocol (a body; the stream is ``ResponsesRun``'s) ---------------

    def chunk(self, index: int, event: Any, totals: ChoiceTotals) -> None:
        return None

    def observe(self, index: int, event: Any) -> None:
        return None

    def tool_calls(self) -> int:
        return len(self.parser.calls) if self.parser is not None else 0

    def usage_chunk(self, totals: Any) -> ResponseBody:
        return ResponseBody()

    def opening(self) -> list[BaseModel]:
        return []  # the stream's own (``ResponsesRun.events``)

    def heartbeat(self) -> ResponseBody:
        return ResponseBody()

    def response(self, totals: Any) -> ResponseBody:
        choice = totals[0]
        self.feed("".join(choice.text), True)
        status = _status(choice)
        self.close_items("completed" if status == "completed" else "incomplete")
        return ResponseBody(**self.body(status, choice))

    # -- events -----------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> dict[str, str]:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return {"event": kind, "data": json.dumps(data, ensure_ascii=False)}

    def feed(self, text: str, final: bool) -> list[dict[str, str]]:
        """The events one round's text adds."""
        if self.parser is None:  # no tools: all text
            return self._text(text) if text else []
        content, deltas = self.parser.feed(text)
        if final:
            more, rest = self.parser.finish()
            content, deltas = content + more, [*deltas, *rest]
        events: list[dict[str, str]] = []
        if content:
            events += self._text(content)
        for delta in deltas:
            if delta.started:
                namespace, name = self.names.split(delta.call.name)
                item = {"type": "function_call", "id": _item_id("fc"), "call_id": delta.call.id,
                        "name": name, "arguments": "", "status": "in_progress"}
                if namespace is not None:
                    item["namespace"] = namespace
                self.items.append(item)
                events.append(self.event("response.output_item.added",
                                         output_index=len(self.items) - 1, item=item))
            item = self.items[-1]
            if delta.arguments:
                item["arguments"] += delta.arguments
                events.append(self.event("response.function_call_arguments.delta",
                                         item_id=item["id"], output_index=len(self.items) - 1,
                                         delta=delta.arguments))
        return events

    def _text(self, content: str) -> list[dict[str, str]]:
        events = []
        if self.text_item is None:
            self.text_item = {"type": "message", "id": _item_id("msg"), "status": "in_progress",
                              "role": "assistant", "content": []}
            self.items.append(self.text_item)
            index = len(self.items) - 1
            events.append(self.event("response.output_item.added", output_index=index,
                                     item=self.text_item))
            self.text_item["content"].append({"type": "output_text", "text": "",
                                              "annotations": []})
            events.append(self.event("response.content_part.added", item_id=self.text_item["id"],
                                     output_index=index, content_index=0,
                                     part={"type": "output_text", "text": "",
                                           "annotations": []}))
        self.text_item["content"][0]["text"] += content
        events.append(self.event("response.output_text.delta", item_id=self.text_item["id"],
                                 output_index=self.items.index(self.text_item),
                                 content_index=0, delta=content))
        return events

    def close_items(self, status: str) -> list[dict[str, str]]:
        events = []
        for index, item in enumerate(self.items):
            item["status"] = status
            if item["type"] == "message":
                part = item["content"][0]
                events.append(self.event("response.output_text.done", item_id=item["id"],
                                         output_index=index, content_index=0,
                                         text=part["text"]))
                events.append(self.event("response.content_part.done", item_id=item["id"],
                                         output_index=index, content_index=0, part=part))
            else:
                events.append(self.event("response.function_call_arguments.done",
                                         item_id=item["id"], output_index=index,
                                         arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index,
                                     item=item))
        return events


def _status(totals: ChoiceTotals) -> str:
    return "incomplete" if totals.finish_reason is FinishReason.LENGTH else "completed"


class ResponsesRun(ResponseRun):
    """One /v1/responses request on the engine, as a body or as typed events."""

    async def events(self) -> AsyncIterator[str | dict[str, str]]:
        """The typed Responses events (sse-starlette sends each dict as one event)."""
        fmt = self.fmt
        assert isinstance(fmt, ResponsesFormat)
        totals = self.totals[0]
        yield fmt.event("response.created", response=fmt.body("in_progress", None))
        yield fmt.event("response.in_progress", response=fmt.body("in_progress", None))
        async for _, item in self.rounds(self.heartbeat_s):
            if isinstance(item, Idle):  # an event a client's idle timer counts
                yield fmt.event("response.in_progress", response=fmt.body("in_progress", None))
                continue
            if isinstance(item, RoundEvent):
                for event in fmt.feed(item.text, item.finished):
                    yield event
            error = self.failed(0)
            if error is not None:
                body = fmt.body("failed", totals)
                body["error"] = {"code": error.code or "server_error", "message": error.message}
                yield fmt.event("response.failed", response=body)
                return
        status = _status(totals)
        for event in fmt.close_items("completed" if status == "completed" else "incomplete"):
            yield event
        self.outcome = "ok"
        yield fmt.event(f"response.{status}", response=fmt.body(status, totals))


# Chat fields a refusal may name, as the Responses request spells them.
RESPONSES_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "response_format": "text.format"}


@contextmanager
def responses_params() -> Iterator[None]:
    """Refusals of the chat request behind a Responses request name the Responses
    fields (``input``, not ``messages``)."""
    try:
        yield
    except APIError as exc:
        head = re.split(r"[.\[]", exc.param or "", maxsplit=1)[0]
        if head in RESPONSES_PARAMS:
            exc.param = RESPONSES_PARAMS[head]
            exc.message = exc.message.replace(head, exc.param)
        raise


@router.post("/responses", **responses_route())
async def create_response(request: Request) -> Response:
    """Stateless Responses API (``store`` and ``previous_response_id`` are refused)."""
    state = gateway_state(request)
    api, engine = await parse_request(request, state, ResponsesRequest)
    hosted = api.hosted_tools()
    if hosted:
        log.info("left out of the prompt, hosted tools this server cannot run: %s",
                 ", ".join(hosted))
    with responses_params():
        try:
            chat = api.chat_request()
        except ValidationError as exc:
            raise from_validation_errors(exc.errors()) from exc
        limits = state.limits(engine)
        check_choices(chat, 1, limits)
        plan = request_tools(chat)
        prompt = await asyncio.to_thread(chat_prompt, engine.target.tokenizer, chat, plan)
        job_id = f"resp_{uuid.uuid4().hex}"
        requests = generation_requests(chat, [prompt], limits, job_id)
        grammar = await request_grammar(state, engine, chat.response_format, plan,
                                        "text.format")
        requests = with_grammar(requests, grammar)
    job = Job(id=job_id, created=int(time.time()), model=state.settings.model_name,
              prompts=[prompt], per_prompt=1, logprobs=False)
    run = ResponsesRun(state, job, ResponsesFormat(job, api, plan, requests[0].sampling),
                       endpoint=request.url.path, user=api.user,
                       trace=request_trace(state, request, job_id, requests, chat),
                       tool_choice=plan.mode if plan is not None else None,
                       operator_cap=operator_cap(chat, limits))
    run.submit(engine, requests)
    return await run.respond(request.receive, api.stream)
