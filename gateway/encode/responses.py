"""The Responses API's encoder: a chat answer as ``output`` items, a ``message`` with
``output_text`` or ``function_call`` items. Streamed, the typed events the SDKs parse:
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` or
``response.function_call_arguments.delta``, their ``.done`` events,
``response.output_item.done``, then ``response.completed`` (``response.incomplete``
when max_output_tokens cut the answer, ``response.failed`` on an error).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from decoding.types import FinishReason, RoundEvent, SamplingParams
from gateway.decode.plan import Job
from gateway.decode.tool_plan import ToolPlan
from gateway.encode.formats import Sent
from gateway.encode.tool_calls import CallParser
from gateway.encode.totals import ChoiceTotals, usage_of
from gateway.wire.errors import APIError
from gateway.wire.responses import ResponsesRequest


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

    # -- the ``Format`` protocol: typed events (sse-starlette sends each dict as one) ------

    def opening(self) -> list[Sent]:
        return [self.event("response.created", response=self.body("in_progress", None)),
                self.event("response.in_progress", response=self.body("in_progress", None))]

    def round(self, index: int, event: RoundEvent, totals: ChoiceTotals) -> list[Sent]:
        return list(self.feed(event.text, event.finished))

    def idle(self) -> list[Sent]:  # an event a client's idle timer counts
        return [self.event("response.in_progress", response=self.body("in_progress", None))]

    def failure(self, error: APIError, totals: ChoiceTotals) -> list[Sent]:
        body = self.body("failed", totals)
        body["error"] = {"code": error.code or "server_error", "message": error.message}
        return [self.event("response.failed", response=body)]

    def closing(self, totals: Sequence[ChoiceTotals]) -> list[Sent]:
        status = _status(totals[0])
        closed = self.close_items("completed" if status == "completed" else "incomplete")
        return [*closed, self.event(f"response.{status}", response=self.body(status, totals[0]))]

    def observe(self, index: int, event: RoundEvent) -> None:
        return None  # the whole body is written from the text (``response``)

    def tool_calls(self) -> int:
        return len(self.parser.calls) if self.parser is not None else 0

    def response(self, totals: Sequence[ChoiceTotals]) -> ResponseBody:
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
