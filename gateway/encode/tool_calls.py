"""Tool calls out of the model's text: parsed as it streams, and as OpenAI sends them.

The grammar writes each call as ``<tool_call>{"name":"NAME","arguments":ARGS}
</tool_call>`` exactly (gateway/decode/tool_plan.py), so the parser needs no JSON scanning:
the name ends at the first ``","arguments":``, the arguments at ``}</tool_call>``.
Argument text streams as it arrives, holding back only what could be the start of
that end. With ``auto`` the answer is text, and calls once ``<tool_call>`` appears:
at the start, or after text where the plan lets calls follow text (the text streams
as content, holding back only what could be the start of ``<tool_call>``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from decoding.types import FinishReason, RoundEvent
from gateway.decode.plan import Job, RequestPlan
from gateway.decode.tool_plan import HEAD, MID, OPEN, TAIL, ToolPlan
from gateway.encode.formats import ChatFormat, CompletionFormat, Format
from gateway.encode.token_texts import TokenTexts
from gateway.encode.totals import ChoiceTotals, finish_reason_text, speculation_of, usage_of
from gateway.wire import bodies


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""
    done: bool = False


@dataclass
class CallDelta:
    """What one piece of text added to a call: its start (id, name) or argument text."""

    index: int
    call: Call
    started: bool  # the call's first delta: carries id and name
    arguments: str


@dataclass
class CallParser:
    """Splits a choice's text into content and tool calls, incrementally."""

    auto: bool
    after_text: bool = False  # with auto: calls may follow text
    buffer: str = ""
    mode: str = ""  # "" undecided, "text" or "calls"
    calls: list[Call] = field(default_factory=list)
    _shown: int = 0  # characters of text handed out as content (calls after text)
    _pos: int = 0  # where the next call (or the current call's head) starts
    _args_start: int = -1  # where the current call's arguments start, -1: in the head
    _sent: int = 0  # argument characters of the current call already handed out

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """The content and the call deltas ``text`` adds."""
        self.buffer += text
        if self.after_text and self.mode != "calls":
            return self._text_until_call()
        if not self.mode:
            if self.auto and not (self.buffer.startswith(OPEN) or OPEN.startswith(self.buffer)):
                self.mode = "text"
                return self.buffer, []
            if not self.buffer.startswith(OPEN) and len(self.buffer) < len(OPEN):
                return "", []
            self.mode = "calls"
        if self.mode == "text":
            return text, []
        return "", self._calls()

    @classmethod
    def of(cls, plan: ToolPlan) -> CallParser:
        """A parser for answers under ``plan``."""
        return cls(auto=plan.mode == "auto", after_text=plan.calls_after_text)

    def _text_until_call(self) -> tuple[str, list[CallDelta]]:
        """Content up to a call's opening tag, and the call's deltas once it has one."""
        start = self.buffer.find(OPEN, self._shown)
        if start < 0:
            safe = len(self.buffer) - _held_back(self.buffer[self._shown:], OPEN)
            content, self._shown = self.buffer[self._shown:safe], max(self._shown, safe)
            self.mode = self.mode or ("text" if content else "")
            return content, []
        content, self._shown = self.buffer[self._shown:start], start
        self.mode, self._pos = "calls", start
        return content, self._calls()

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The rest, once the choice has ended (a text answer shorter than a call's
        start, or the arguments of a call cut short by max_tokens)."""
        if self.after_text and self.mode != "calls":
            rest, self._shown = self.buffer[self._shown:], len(self.buffer)
            self.mode = "text"
            return rest, []
        if self.mode in ("", "text"):
            rest = self.buffer if not self.mode else ""
            self.mode = "text"
            return rest, []
        deltas = self._calls()
        if self._args_start >= 0 and self.calls and not self.calls[-1].done:
            rest = self.buffer[self._args_start + self._sent:]
            if rest:
                deltas.append(self._arguments(rest))
        return "", deltas

    def _calls(self) -> list[CallDelta]:
        deltas: list[CallDelta] = []
        while True:
            if self._args_start < 0:  # the head: <tool_call>{"name":"NAME","arguments":
                head = self.buffer.find(HEAD, self._pos)
                mid = self.buffer.find(MID, head + len(HEAD)) if head >= 0 else -1
                if mid < 0:
                    return deltas
                call = Call(call_id(), self.buffer[head + len(HEAD):mid])
                self.calls.append(call)
                deltas.append(CallDelta(len(self.calls) - 1, call, True, ""))
                self._args_start, self._sent = mid + len(MID), 0
            end = self.buffer.find(TAIL, self._args_start)
            if end < 0:
                args = self.buffer[self._args_start:]
                safe = len(args) - _held_back(args, TAIL)
                if safe > self._sent:
                    deltas.append(self._arguments(args[self._sent:safe]))
                return deltas
            args = self.buffer[self._args_start:end]  # TAIL's brace closes the call object
            if len(args) > self._sent:
                deltas.append(self._arguments(args[self._sent:]))
            self.calls[-1].done = True
            self._pos, self._args_start = end + len(TAIL), -1

    def _arguments(self, text: str) -> CallDelta:
        call = self.calls[-1]
        call.arguments += text
        self._sent += len(text)
        return CallDelta(len(self.calls) - 1, call, False, text)


def _held_back(text: str, mark: str) -> int:
    """How much of the end of ``text`` could be the start of ``mark``."""
    for n in range(min(len(mark), len(text)), 0, -1):
        if mark.startswith(text[-n:]):
            return n
    return 0


def merge(deltas: Sequence[CallDelta]) -> list[bodies.ToolCallDelta]:
    """Deltas as OpenAI streams them: one entry per call touched, id and name on the
    call's first."""
    out: dict[int, bodies.ToolCallDelta] = {}
    for d in deltas:
        entry = out.get(d.index)
        if entry is None:
            name = d.call.name if d.started else None
            entry = bodies.ToolCallDelta(index=d.index, id=d.call.id if d.started else None,
                                         type="function" if d.started else None,
                                         function=bodies.FunctionDelta(name=name, arguments=""))
            out[d.index] = entry
        entry.function.arguments = (entry.function.arguments or "") + d.arguments
    return list(out.values())


class ToolChatFormat(ChatFormat):
    """Chat completions whose answers may be tool calls."""

    def __init__(self, job: Job, texts: TokenTexts, hidden_ids: frozenset[int],
                 plan: ToolPlan) -> None:
        super().__init__(job, texts, hidden_ids)
        self.plan = plan
        self.parsers = [CallParser.of(plan) for _ in range(self.count)]

    def tool_calls(self) -> int:
        return sum(len(parser.calls) for parser in self.parsers)

    def finish_reason(self, index: int, reason: FinishReason | None) -> str | None:
        text = finish_reason_text(reason)
        if text == "stop" and self.parsers[index].calls:
            return "tool_calls"
        return text

    def chunk(self, index: int, event: RoundEvent, totals: ChoiceTotals
              ) -> bodies.ChatCompletionChunk | None:
        parser = self.parsers[index]
        content, deltas = parser.feed(event.text)
        if event.finished:
            more, rest = parser.finish()
            content, deltas = content + more, [*deltas, *rest]
        first = not self._started[index]
        finish = self.finish_reason(index, event.finish_reason)
        if not (first or content or deltas or finish):
            return None
        self._started[index] = True
        delta = bodies.ChatDelta(role="assistant" if first else None, content=content or None,
                                 tool_calls=merge(deltas) or None)
        if first and not (content or deltas):
            delta.content = ""
        choice = bodies.ChatChunkChoice(index=index, delta=delta, finish_reason=finish)
        return self._body(bodies.ChatCompletionChunk, [choice],
                          speculation=totals.stats() if event.finished else None)

    def response(self, totals: Sequence[ChoiceTotals]) -> bodies.ChatCompletion:
        choices = []
        for i, t in enumerate(totals):
            parser = CallParser.of(self.plan)
            content, _ = parser.feed("".join(t.text))
            more, _ = parser.finish()
            text = content + more  # with calls: the text before them, as streamed
            calls = [bodies.ToolCallOut(id=c.id, function=bodies.FunctionCallOut(
                name=c.name, arguments=c.arguments)) for c in parser.calls]
            self.parsers[i] = parser
            choices.append(bodies.ChatChoice(
                index=i, message=bodies.ChatMessageOut(
                    content=text if text or not calls else None, tool_calls=calls or None),
                finish_reason=self.finish_reason(i, t.finish_reason)))
        return self._body(bodies.ChatCompletion, choices,
                          usage=usage_of(totals, self.job.per_prompt),
                          speculation=speculation_of(totals))


def format_for(plan: RequestPlan, texts: TokenTexts, hidden_ids: frozenset[int]) -> Format:
    """The format that writes a planned chat or completions request's answer: with tool
    calls when tools may be called, else plain chat or completions."""
    if plan.tools is not None:
        return ToolChatFormat(plan.job, texts, hidden_ids, plan.tools)
    if plan.chat:
        return ChatFormat(plan.job, texts, hidden_ids)
    return CompletionFormat(plan.job, texts, hidden_ids)
