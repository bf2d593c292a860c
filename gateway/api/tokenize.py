"""``POST /tokenize`` and ``POST /detokenize``, with vLLM's field names.

``/tokenize`` counts the tokens of a ``prompt`` (as ``/v1/completions`` encodes it) or
of chat ``messages`` rendered by the model's chat template (as ``/v1/chat/completions``
renders them, ``tools`` included), and returns their ids, their count and the model's
context length. ``/detokenize`` turns ids back into text (as ``echo`` shows a token-id
prompt). ``model`` is optional; when given it must be one the server serves.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from gateway.api.intake import gateway_state, load_json, parse_body, read_body, require_api_key
from gateway.api.openapi import MODEL_ERRORS, error_responses, ref
from gateway.decode.tool_plan import render_messages, tool_plan
from gateway.service.state import GatewayState
from gateway.wire.errors import InvalidRequestError, model_not_found
from gateway.wire.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

ERRORS = (400, 404, 413, *MODEL_ERRORS)


def _route(request_schema: dict[str, Any], response: type[BaseModel], summary: str
           ) -> dict[str, Any]:
    body = {"required": True, "content": {"application/json": {"schema": request_schema}}}
    return {"responses": {200: {"model": response, "description": summary},
                          **error_responses(*ERRORS)},
            "openapi_extra": {"requestBody": body}}


router = APIRouter(dependencies=[Depends(require_api_key)])


async def _body(request: Request, state: GatewayState) -> bytes:
    state.require_engine()
    return await read_body(request, state.settings.max_body_bytes)


def _check_model(state: GatewayState, name: str | None) -> None:
    if name is not None and name not in state.aliases:
        raise model_not_found(name)


@router.post("/tokenize", **_route(
    {"anyOf": [ref(TokenizeCompletionRequest), ref(TokenizeChatRequest)]}, TokenizeResponse,
    "The prompt's or the rendered messages' token ids and their count."))
async def tokenize(request: Request) -> TokenizeResponse:
    state = gateway_state(request)
    body = await _body(request, state)
    payload = load_json(body)
    chat = isinstance(payload, dict) and "messages" in payload
    parsed: TokenizeCompletionRequest | TokenizeChatRequest = (
        parse_body(TokenizeChatRequest, body) if chat
        else parse_body(TokenizeCompletionRequest, body))
    _check_model(state, parsed.model)
    tokenizer = state.require_engine().target.tokenizer
    ids = await asyncio.to_thread(_encode, tokenizer, parsed)
    return TokenizeResponse(
        count=len(ids), max_model_len=state.require_engine().target.max_context, tokens=ids,
        token_strs=[str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
        if parsed.return_token_strs else None)


def _encode(tokenizer: Any, request: TokenizeCompletionRequest | TokenizeChatRequest
            ) -> list[int]:
    if isinstance(request, TokenizeCompletionRequest):
        return [int(i) for i in tokenizer.encode(request.prompt,
                                                 add_special_tokens=request.add_special_tokens)]
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("This model has no chat template; send a prompt instead.",
                                  param="messages")
    plan = tool_plan(request.tools, None, None)
    messages, tools = render_messages(request.messages, plan, tokenizer)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message)
    except Exception as exc:  # a template that refuses the conversation (role order, ...)
        raise InvalidRequestError(f"The messages could not be formatted: {exc}",
                                  param="messages") from exc
    return [int(i) for i in tokenizer.encode(text,
                                             add_special_tokens=request.add_special_tokens)]


@router.post("/detokenize", **_route(ref(DetokenizeRequest), DetokenizeResponse,
                                     "The text of the token ids."))
async def detokenize(request: Request) -> DetokenizeResponse:
    state = gateway_state(request)
    parsed = parse_body(DetokenizeRequest, await _body(request, state))
    _check_model(state, parsed.model)
    target = state.require_engine().target
    for i, token in enumerate(parsed.tokens):
        if token >= target.vocab_size:
            raise InvalidRequestError(
                f"Token id {token} is outside the vocabulary (0..{target.vocab_size - 1}).",
                param=f"tokens[{i}]", code="invalid_value")
    text = await asyncio.to_thread(target.tokenizer.decode, list(parsed.tokens),
                                   skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    return DetokenizeResponse(prompt=str(text))
