"""The HTTP endpoints: completions, models, health and readiness."""

from __future__ import annotations

import logging
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from decoding.engine import Engine
from gateway.api.intake import gateway_state, parse_request, require_api_key
from gateway.api.openapi import MODEL_ERRORS, completion_route, error_responses
from gateway.decode.params import AnyRequest
from gateway.decode.plan import plan_request
from gateway.encode.tool_calls import format_for
from gateway.predict.run import ResponseRun, request_trace
from gateway.service.curve_store import MEASURED
from gateway.service.state import GatewayState
from gateway.wire.bodies import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    Health,
    HealthFailure,
    ModelCard,
    ModelList,
    NotReady,
    Readiness,
)
from gateway.wire.errors import model_not_found
from gateway.wire.requests import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

router = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


@v1.post("/chat/completions",
         **completion_route(ChatCompletionRequest, ChatCompletion, ChatCompletionChunk))
async def chat_completions(request: Request) -> Response:
    return await _answer(request, ChatCompletionRequest, "chatcmpl")


@v1.post("/completions", **completion_route(CompletionRequest, Completion, Completion))
async def completions(request: Request) -> Response:
    return await _answer(request, CompletionRequest, "cmpl")


async def _answer(request: Request, kind: type[AnyRequest], prefix: str) -> Response:
    """Decode, predict, encode: the body read and validated, planned into the engine's
    work (``plan_request``), the format that will write the answer, and the run that
    submits the plan and answers as a stream or one body."""
    state = gateway_state(request)
    api_request, engine = await parse_request(request, state, kind)
    plan = await plan_request(state, engine, api_request, f"{prefix}-{uuid.uuid4().hex}",
                              state.settings.model_name)
    fmt = format_for(plan, state.token_texts(), engine.target.eos_token_ids)
    run = ResponseRun(state, plan, fmt, request.url.path, request_trace(state, request, plan))
    run.submit(engine)
    return await run.respond(request.receive, api_request.stream)


def _card(state: GatewayState) -> ModelCard:
    engine = state.require_engine()
    settings = state.settings
    return ModelCard(
        id=settings.model_name,
        created=state.created,
        max_model_len=engine.target.max_context,
        metadata={
            "target": settings.target,
            "draft": settings.draft,
            "drafters": [*sorted(engine.drafters), "none"],
            "default_drafter": engine.default_drafter or "none",
            "draft_backend": engine.info.get("draft_backend", "torch"),
            "dtype": engine.info.get("activations", settings.dtype),
            "weights": engine.info.get("weights", settings.dtype),
            "draft_dtype": engine.info.get("draft_dtype"),
            "draft_auto": engine.info.get("draft_auto"),  # with --draft auto: why that mix
            "kernels": engine.info.get("kernels", "torch"),
            "product_activations": engine.info.get("product_activations", settings.dtype),
            "speculation": _speculation(engine),
            "aliases": sorted(state.aliases),
            "sampling_defaults": state.sampling.metadata(),
        },
    )


def _speculation(engine: Engine) -> dict[str, Any] | None:
    """The measured verify curve, each drafter's cost and the ceilings they promise, and
    whether the curve was measured at this start or read from the store (and when it was
    measured)."""
    profile = engine.speculation_profile
    if profile is None:
        return None
    return {**profile, "curve_source": engine.info.get("curve_source", MEASURED),
            "measured_at": engine.info.get("curve_measured_at")}


@v1.get("/models", responses=error_responses(*MODEL_ERRORS))
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_card(gateway_state(request))])


@v1.get("/models/{model_id:path}", responses=error_responses(404, *MODEL_ERRORS))
async def get_model(request: Request, model_id: str) -> ModelCard:
    state = gateway_state(request)
    if model_id not in state.aliases:
        raise model_not_found(model_id)
    return _card(state)


@router.get("/health", responses={
    200: {"model": Health, "description": "The process is alive."},
    503: {"model": HealthFailure, "description": "Loading the models failed."}})
async def health(request: Request) -> JSONResponse:
    """Liveness: the process answers; 503 only when the model failed to load."""
    state = gateway_state(request)
    if state.load_error is not None:
        return JSONResponse(HealthFailure(error=state.load_error).model_dump(), status_code=503)
    return JSONResponse(Health().model_dump())


@router.get("/ready", responses={
    200: {"model": Readiness, "description": "Loaded, warm and admitting requests."},
    503: {"model": NotReady, "description": "Loading, failed to load, or draining."}})
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 once the models are loaded and warm, 503 before and while draining;
    the body says whether the prefix cache's store answers."""
    state = gateway_state(request)
    if state.accepting and state.engine is not None:
        engine = state.engine
        body = Readiness(running=engine.num_running, waiting=engine.num_waiting,
                         prefix_cache=await state.prefix_cache_health())
        return JSONResponse(body.model_dump())
    status: Literal["loading", "draining", "failed"] = "loading"
    if state.draining:
        status = "draining"
    elif state.load_error is not None:
        status = "failed"
    return JSONResponse(NotReady(status=status).model_dump(), status_code=503)


router.include_router(v1)
