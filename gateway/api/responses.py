"""``POST /v1/responses``: the Responses API, stateless, on the chat pipeline: the
request becomes a chat request (gateway/wire/responses.py), planned as a chat request
is, and its answer is written by the Responses encoder (gateway/encode/responses.py)."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import APIRouter, Depends, Request, Response
from pydantic import ValidationError

from gateway.api.intake import gateway_state, parse_request, require_api_key
from gateway.api.openapi import responses_route
from gateway.decode.plan import plan_request
from gateway.encode.responses import ResponsesFormat
from gateway.predict.run import ResponseRun, request_trace
from gateway.wire.errors import APIError, from_validation_errors
from gateway.wire.responses import ResponsesRequest

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


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
        plan = await plan_request(state, engine, chat, f"resp_{uuid.uuid4().hex}",
                                  state.settings.model_name, grammar_param="text.format",
                                  seeded=False)
    fmt = ResponsesFormat(plan.job, api, plan.tools, plan.requests[0].sampling)
    run = ResponseRun(state, plan, fmt, request.url.path, request_trace(state, request, plan))
    run.submit(engine)
    return await run.respond(request.receive, api.stream)
