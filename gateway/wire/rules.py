"""The request rules that tie one field to another, as JSON Schema for /openapi.json.

The validators in ``gateway.wire.requests`` enforce them; these say the same in the published
schema, so that a client (or a fuzzer) that follows the schema sends what the server
accepts. Two rules JSON Schema cannot state, since it compares no two values of a
document, are said in their fields' descriptions: a named ``tool_choice`` must be one of
``tools``, and tool function names must be unique.
"""

from __future__ import annotations

from typing import Any

# ``requests._check_common``: without ``stream: true``, ``stream_options``
# is absent or null (OpenAI refuses it with a 400 too).
STREAM_OPTIONS_RULE: dict[str, Any] = {"allOf": [
    {"if": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
     "else": {"properties": {"stream_options": {"type": "null"}}}},
]}


# ``ChatCompletionRequest._check``: a positive ``top_logprobs``
# needs ``logprobs: true`` (OpenAI refuses it otherwise, with a 400 naming top_logprobs).
TOP_LOGPROBS_RULE: dict[str, Any] = {
    "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
           "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}}


# ``ChatCompletionRequest._check`` (and the Responses API's, through it): "required" or a
# named function needs tools.
TOOL_CHOICE_RULE: dict[str, Any] = {
    "if": {"properties": {"tool_choice": {"anyOf": [{"const": "required"},
                                                   {"type": "object"}]}},
           "required": ["tool_choice"]},
    "then": {"properties": {"tools": {"type": "array", "minItems": 1}},
             "required": ["tools"]}}


# ``CompletionRequest._check``: ``max_tokens: 0`` generates nothing, so it is taken only with
# ``echo: true`` (the prompt alone, with its logprobs when ``logprobs`` is set).
MAX_TOKENS_ZERO_RULE: dict[str, Any] = {
    "if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
    "then": {"properties": {"echo": {"const": True}}, "required": ["echo"]}}

# The Responses API's form of it: "required" or a named function needs a function among
# the tools (a hosted tool cannot be called here, and a namespace holds functions).
RESPONSES_TOOL_CHOICE_RULE: dict[str, Any] = {
    "if": TOOL_CHOICE_RULE["if"],
    "then": {"properties": {"tools": {"type": "array", "contains": {
        "type": "object", "properties": {"type": {"enum": ["function", "namespace"]}},
        "required": ["type"]}}},
             "required": ["tools"]}}
