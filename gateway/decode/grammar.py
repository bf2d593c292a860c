"""Structured outputs: the grammar a request's ``response_format`` and tools ask for,
compiled off the model thread with a time limit, and cached.

``json_schema`` constrains the answer to the schema whether or not ``strict`` is set
(constraining is exact and cheap, so there is nothing to gain from leaving it loose);
``json_object`` to any JSON object; ``text`` constrains nothing. An invalid, unsupported
or too costly schema is a 400 naming the problem.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from decoding.constraints import Grammar
from decoding.engine import Engine
from gateway.decode.tool_plan import ToolPlan, tag_tokens, tool_grammar
from gateway.wire.errors import InvalidRequestError
from gateway.wire.tool_specs import JsonObjectFormat, JsonSchemaFormat
from grammars.guidance import GrammarCompiler, GrammarError
from observability.telemetry import Telemetry

COMPILE_TIMEOUT_S = 10.0  # one grammar's compilation; the engine's fuel limits bound it too


class GrammarHost(Protocol):
    """What compiling a request's grammar needs of the server: its compiler, built once
    per engine, and its telemetry (the gateway's state is one)."""

    telemetry: Telemetry | None

    def grammar_compiler(self, engine: Engine) -> GrammarCompiler: ...


def format_schema(response_format: Any) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` asks for (None: plain text)."""
    if isinstance(response_format, JsonSchemaFormat):
        schema = response_format.json_schema.schema_
        return schema if schema is not None else {}
    if isinstance(response_format, JsonObjectFormat):
        return {"type": "object"}
    return None


def _build(grammars: GrammarCompiler, schema: dict[str, Any] | None,
           plan: ToolPlan | None) -> Grammar | None:
    if plan is not None:
        return grammars.lark(tool_grammar(plan, schema, tag_tokens(grammars.tokenizer)))
    if schema is not None:
        return grammars.json_schema(schema)
    return None


async def request_grammar(state: GrammarHost, engine: Engine, response_format: Any,
                          plan: ToolPlan | None, param: str = "response_format"
                          ) -> Grammar | None:
    """The request's grammar, compiled in a worker thread within ``COMPILE_TIMEOUT_S``."""
    schema = format_schema(response_format)
    if schema is None and plan is None:
        return None
    grammars = state.grammar_compiler(engine)
    if state.telemetry is not None:
        kind = "tools" if plan is not None else (
            "json_object" if isinstance(response_format, JsonObjectFormat) else "json_schema")
        state.telemetry.metrics.constrained_requests.labels(state.telemetry.model, kind).inc()
    where = "tools" if plan is not None else param
    await asyncio.to_thread(grammars.prepare)  # the vocabulary's table, once, untimed
    try:
        return await asyncio.wait_for(asyncio.to_thread(_build, grammars, schema, plan),
                                      COMPILE_TIMEOUT_S)
    except TimeoutError as exc:
        raise InvalidRequestError(
            f"The {'tools' if plan is not None else 'schema'} took longer than "
            f"{COMPILE_TIMEOUT_S:.0f} s to compile; simplify it.", param=where,
            code="invalid_schema") from exc
    except GrammarError as exc:
        raise InvalidRequestError(f"The schema cannot be used: {exc}", param=where,
                                  code="invalid_schema") from exc
