"""Request and response bodies of ``POST /tokenize`` and ``POST /detokenize``, with
vLLM's field names (``gateway.api.tokenize`` serves them)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from gateway.wire.requests import ChatMessage, Integral, invalid_value, refuse
from gateway.wire.tool_specs import MAX_TOOLS, ChatTool

TOKEN_ID_MAX = (1 << 63) - 1
# an integral float is that id, as everywhere in the API (the bounds stated again for the
# schema: pydantic writes a wrapped integer's as "ge"/"le")
TokenId = Annotated[Integral, Field(ge=0, le=TOKEN_ID_MAX),
                    WithJsonSchema({"type": "integer", "minimum": 0, "maximum": TOKEN_ID_MAX})]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TokenizeCompletionRequest(_Strict):
    """Tokens of a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(
        default=True, description="Add the tokenizer's special tokens (e.g. BOS) where it "
                                  "adds any; /v1/completions adds none.")
    return_token_strs: bool | None = Field(
        default=False, description="Also return each token's string in the vocabulary.")


class TokenizeChatRequest(_Strict):
    """Tokens of chat messages rendered by the model's chat template."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, json_schema_extra={
        "if": {"properties": {"continue_final_message": {"const": True}},
               "required": ["continue_final_message"]},
        "then": {"properties": {"add_generation_prompt": {"const": False}},
                 "required": ["add_generation_prompt"]}})
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = Field(
        default=True, description="Open the assistant's turn after the messages, as "
                                  "/v1/chat/completions does.")
    continue_final_message: bool = Field(
        default=False, description="Leave the last message open for the model to continue "
                                   "(not with add_generation_prompt).")
    add_special_tokens: bool = Field(
        default=False, description="Add the tokenizer's special tokens on top of what the "
                                   "template writes.")
    return_token_strs: bool | None = Field(
        default=False, description="Also return each token's string in the vocabulary.")
    tools: list[ChatTool] | None = Field(
        default=None, max_length=MAX_TOOLS,
        description="Function names must be unique (a request that repeats one is refused).")
    chat_template: Annotated[Any, refuse()] = None
    chat_template_kwargs: Annotated[Any, refuse({})] = None

    @model_validator(mode="after")
    def _check(self) -> TokenizeChatRequest:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise invalid_value("tools", "tool function names must be unique")
        if self.add_generation_prompt and self.continue_final_message:
            raise invalid_value("continue_final_message", "continue_final_message needs "
                                "add_generation_prompt set to false (it is true unless set)")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId] = Field(
        description="Ids in the model's vocabulary (/openapi.json bounds them once the model "
                    "is loaded).")


class DetokenizeResponse(BaseModel):
    prompt: str


REQUEST_MODELS: tuple[type[BaseModel], ...] = (TokenizeCompletionRequest, TokenizeChatRequest,
                                               DetokenizeRequest)
