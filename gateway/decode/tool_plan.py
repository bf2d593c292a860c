"""Tools in the prompt and in the grammar.

The model sees its tools through its chat template when the template takes
``tools``; otherwise through the default format below, appended to the system
prompt. Either way a call is written as ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` (compact JSON, name first), one per call, and nothing else:

- ``required`` and a named choice: the output is constrained to one or more such
  calls (one unless ``parallel_tool_calls``), each valid against its function's
  JSON schema (a named choice's function only; the prompt lists every tool);
- ``auto``: the output is text, calls, or text followed by calls (as instruction-tuned
  models often write a sentence before a call); the text is anything without
  ``<tool_call>``, and what follows one is constrained as above. With a JSON
  ``response_format`` the text must match it and calls may only come first;
- ``none``: the tools are left out of the prompt and nothing is constrained.

Assistant messages that carried ``tool_calls`` are rendered back in the same
format; ``tool`` messages as ``<tool_response>...</tool_response>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from gateway.wire.requests import ChatCompletionRequest
from gateway.wire.tool_specs import (
    ChatTool,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    ToolChoice,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEAD = OPEN + '{"name":"'  # the grammar writes calls compactly, the name first
MID = '","arguments":'
TAIL = "}" + CLOSE
SEPARATOR = "\n"  # between parallel calls

DEFAULT_INSTRUCTIONS = (
    "You may call functions to help with the user's request. The functions, as JSON "
    "schemas:\n<tools>\n{tools}\n</tools>\nTo call functions, answer with one "
    '<tool_call>{{"name": <function name>, "arguments": <arguments as a JSON object>}}'
    "</tool_call> per call and nothing else. Function results come back as "
    "<tool_response>...</tool_response>.")


@dataclass(frozen=True)
class ToolPlan:
    """The tools a request offers and how the answer may use them."""

    tools: tuple[ChatTool, ...]  # all of them, as the prompt lists them
    mode: str  # "auto", "required" or "named"
    parallel: bool
    named: str | None = None  # the function a named choice forces
    text_format: bool = False  # with auto: a text answer must match a JSON response_format

    @property
    def calls_after_text(self) -> bool:
        """Whether calls may follow text (``auto`` with free text)."""
        return self.mode == "auto" and not self.text_format

    @property
    def constrained(self) -> list[ChatTool]:
        """The functions a call may name."""
        return [t for t in self.tools if self.named in (None, t.function.name)]


def tool_plan(tools: Sequence[ChatTool] | None, choice: ToolChoice | None,
              parallel: bool | None) -> ToolPlan | None:
    """None when no tool can be called (no tools, or ``tool_choice: none``)."""
    if not tools or choice == "none":
        return None
    mode = "auto" if choice is None else choice if isinstance(choice, str) else "named"
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    # the prompt lists every tool whatever the choice, so that it stays the same from turn
    # to turn (and its KV in the prefix cache); the grammar forces the named one
    return ToolPlan(tuple(tools), mode, parallel is not False, named)


def request_tools(request: ChatCompletionRequest) -> ToolPlan | None:
    """A chat request's tool plan."""
    plan = tool_plan(request.tools, request.tool_choice, request.parallel_tool_calls)
    json_text = isinstance(request.response_format, JsonObjectFormat | JsonSchemaFormat)
    return replace(plan, text_format=True) if plan is not None and json_text else plan


# -- the prompt ---------------------------------------------------------------------


def template_handles_tools(tokenizer: Any) -> bool:
    return "tools" in str(getattr(tokenizer, "chat_template", "") or "")


def tool_schema(tool: ChatTool) -> dict[str, Any]:
    return tool.model_dump(mode="json", by_alias=True, exclude_none=True)


def render_call(name: str, arguments: str) -> str:
    """A call in the prompt format (``arguments`` is JSON text, kept when it parses)."""
    try:
        args = json.dumps(json.loads(arguments), ensure_ascii=False, separators=(",", ":"))
    except ValueError:
        args = json.dumps(arguments)
    return f'{HEAD}{name}{MID}{args}{TAIL}'


def with_instructions(messages: list[dict[str, Any]], plan: ToolPlan | None
                      ) -> list[dict[str, Any]]:
    """The default tool format: the tools described in the system prompt."""
    if plan is None:
        return messages
    listing = "\n".join(json.dumps(tool_schema(t), ensure_ascii=False) for t in plan.tools)
    text = DEFAULT_INSTRUCTIONS.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{text}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# -- the grammar --------------------------------------------------------------------


def _call_schema(tool: ChatTool) -> dict[str, Any]:
    parameters = tool.function.parameters or {"type": "object", "properties": {},
                                              "additionalProperties": False}
    return {"type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


@dataclass(frozen=True)
class TagTokens:
    """A vocabulary's own tokens for ``<tool_call>`` and ``</tool_call>`` (Qwen2.5's and
    Hermes' models write each tag as one token), None where it spells them out. The
    grammar engine keeps added tokens apart from the text they spell, so the grammar
    names them as tokens too: a model writes its calls the way it was taught."""

    open: int | None = None
    close: int | None = None


def tag_tokens(tokenizer: Any) -> TagTokens:
    added = tokenizer.get_added_vocab()
    return TagTokens(added.get(OPEN), added.get(CLOSE))


def _tag(text: str, token: int | None) -> str:
    return json.dumps(text) if token is None else f"({json.dumps(text)} | <[{token}]>)"


def _no_call() -> str:
    """A lexeme (llguidance's ``&`` and ``~``) for text without ``<tool_call>``."""
    return f"/(?s:.*)/ & ~/(?s:.*){re.escape(OPEN)}(?s:.*)/"


def tool_grammar(plan: ToolPlan, text_schema: dict[str, Any] | None = None,
                 tags: TagTokens = TagTokens()) -> str:
    """The Lark grammar (llguidance's dialect) an answer under ``plan`` must match;
    ``text_schema``: with ``auto``, a non-call answer must match it (response_format);
    ``tags``: the vocabulary's tokens for the call tags."""
    schemas = [_call_schema(t) for t in plan.constrained]
    body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    body = {**body, "x-guidance": {"whitespace_flexible": False}}
    more = ' ("\\n" call)*' if plan.parallel else ""
    close = _tag(CLOSE, tags.close)
    lines = [f"calls: call{more}",
             f"call: {_tag(OPEN, tags.open)} body {close}",
             f"body: %json {json.dumps(body, ensure_ascii=False)}"]
    if plan.mode != "auto":
        return "\n".join(["start: calls", *lines]) + "\n"
    if text_schema is None:
        # one lexeme runs from the text to a spelt-out opening tag: a text lexeme alone
        # would have to end before a tag it could otherwise swallow
        starts = ["TEXT", f"LEAD body {close}{more}"]
        if tags.open is not None:
            starts.append(f"TEXT? <[{tags.open}]> body {close}{more}")
        return "\n".join([f"start: {' | '.join(starts)}", *lines[1:],
                          f"TEXT: {_no_call()}",
                          f"LEAD: ({_no_call()}) {json.dumps(OPEN)}"]) + "\n"
    text = {**text_schema, "x-guidance": {"whitespace_flexible": False}}
    lines.append(f"text: %json {json.dumps(text, ensure_ascii=False)}")
    return "\n".join(["start: calls | text", *lines]) + "\n"


def render_messages(messages: Sequence[Any], plan: ToolPlan | None, tokenizer: Any
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Chat messages (``ChatMessage``s) as the template's dicts, and the tools to pass
    the template (None: the default format is in the system prompt instead)."""
    native = plan is not None and template_handles_tools(tokenizer)
    out: list[dict[str, Any]] = []
    for m in messages:
        text = m.text()
        if m.role == "tool":
            out.append({"role": "tool", "content": f"<tool_response>\n{text}\n</tool_response>"}
                       if not native else {"role": "tool", "content": text,
                                           "tool_call_id": m.tool_call_id})
        elif m.role == "assistant" and m.tool_calls:
            calls = SEPARATOR.join(render_call(c.function.name, c.function.arguments)
                                   for c in m.tool_calls)
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        else:
            out.append({"role": m.template_role(), "content": text})
    if native:
        assert plan is not None
        return out, [tool_schema(t) for t in plan.tools]
    return with_instructions(out, plan), None
