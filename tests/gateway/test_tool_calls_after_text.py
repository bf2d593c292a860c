"""Tool calls after text under ``tool_choice: "auto"``: the grammar lets an answer write a
sentence and then calls (as Qwen2.5's template teaches), and the answer comes back as
content followed by tool calls, on chat and on the Responses API, streamed and whole.

The random tiny model never writes a call on its own, so the answers here are exact token
sequences of the default model's tokenizer: the grammar is the real compiled one, and the
formats get the round events a server would hand them, split at every token.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from decoding.constraints import Grammar
from decoding.types import FinishReason, RoundEvent
from gateway.decode.params import Prompt, sampling_params
from gateway.decode.plan import Job
from gateway.decode.tool_plan import ToolPlan, request_tools, tag_tokens, tool_grammar
from gateway.encode.responses import ResponsesFormat
from gateway.encode.token_texts import TokenTexts
from gateway.encode.tool_calls import ToolChatFormat
from gateway.encode.totals import ChoiceTotals
from gateway.wire.requests import ChatCompletionRequest
from gateway.wire.responses import ResponsesRequest
from grammars.guidance import GrammarCompiler
from runtime.files import model_store

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TEXT = "Let me look that up <tool_ca... now.\n"  # a near-tag in the text is still text
CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
BERLIN = '<tool_call>{"name":"get_weather","arguments":{"city":"Berlin"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase) -> GrammarCompiler:
    eos = tokenizer.eos_token_id
    return GrammarCompiler(tokenizer, len(tokenizer), eos, stop_ids=frozenset({eos}))


def _plan(**request: Any) -> ToolPlan:
    plan = request_tools(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": ASK, "tools": [WEATHER], **request}))
    assert plan is not None
    return plan


def _grammar(compiler: GrammarCompiler, plan: ToolPlan,
             schema: dict[str, Any] | None = None) -> Grammar:
    return compiler.lark(tool_grammar(plan, schema, tag_tokens(compiler.tokenizer)))


def _takes(grammar: Grammar, tokenizer: PreTrainedTokenizerBase, text: str) -> bool:
    """Whether the grammar takes ``text`` whole and then lets the answer end."""
    matcher = grammar.matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.advance(ids) and (matcher.is_terminated()
                                     or matcher.valid_prefix([tokenizer.eos_token_id]) == 1)


def test_auto_takes_text_then_calls(compiler: GrammarCompiler,
                                    tokenizer: PreTrainedTokenizerBase) -> None:
    auto = _grammar(compiler, _plan())
    for answer in (TEXT, CALL, TEXT + CALL, TEXT + CALL + "\n" + BERLIN, "<tool_c"):
        assert _takes(auto, tokenizer, answer), answer
    for answer in (TEXT + CALL + " Done.", TEXT + '<tool_call>{"name":"nope"',
                   TEXT + '<tool_call>{"name":"get_weather","arguments":{}}</tool_call>'):
        assert not _takes(auto, tokenizer, answer), answer
    single = _grammar(compiler, _plan(parallel_tool_calls=False))
    assert _takes(single, tokenizer, TEXT + CALL)
    assert not _takes(single, tokenizer, TEXT + CALL + "\n" + BERLIN)


def test_forced_calls_and_json_text_keep_calls_first(compiler: GrammarCompiler,
                                                     tokenizer: PreTrainedTokenizerBase) -> None:
    for forced in (_plan(tool_choice="required"),
                   _plan(tool_choice={"type": "function", "function": {"name": "get_weather"}})):
        grammar = _grammar(compiler, forced)
        assert _takes(grammar, tokenizer, CALL)
        assert not _takes(grammar, tokenizer, TEXT + CALL)
        assert not _takes(grammar, tokenizer, TEXT)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}},
              "required": ["answer"], "additionalProperties": False}
    json_plan = _plan(response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": schema}})
    assert not json_plan.calls_after_text
    grammar = _grammar(compiler, json_plan, schema)
    assert _takes(grammar, tokenizer, '{"answer":"Sunny"}')
    assert _takes(grammar, tokenizer, CALL)
    assert not _takes(grammar, tokenizer, '{"answer":"Sunny"}' + CALL)


def _events(tokenizer: PreTrainedTokenizerBase, answer: str) -> list[RoundEvent]:
    """The answer one token a round, as the engine streams it, ending at EOS."""
    ids = tokenizer.encode(answer, add_special_tokens=False)
    events, shown = [], ""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        events.append(RoundEvent(token_ids=(ids[n - 1],), text=text[len(shown):],
                                 draft_tokens=0, accepted_tokens=0, completion_tokens=n))
        shown = text
    eos = tokenizer.eos_token_id
    events.append(RoundEvent(token_ids=(eos,), text="", draft_tokens=0, accepted_tokens=0,
                             completion_tokens=len(ids) + 1, finish_reason=FinishReason.STOP))
    return events


def _job() -> Job:
    return Job(id="chatcmpl-test", created=0, model="m", prompts=[Prompt((1,), "")],
               per_prompt=1, logprobs=False)


def test_chat_gives_the_text_as_content_and_the_calls_as_tool_calls(
        tokenizer: PreTrainedTokenizerBase) -> None:
    answer = TEXT + CALL + "\n" + BERLIN
    events = _events(tokenizer, answer)
    streamed = ToolChatFormat(_job(), TokenTexts(tokenizer), frozenset(), _plan())
    totals = ChoiceTotals(drafter=None)
    chunks = list(streamed.opening_chunks())
    for event in events:
        totals.add(event)
        chunk = streamed.chunk(0, event, totals)
        if chunk is not None:
            chunks.append(chunk)
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant"
    content = "".join(d.content or "" for d in deltas)
    assert content == TEXT
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert not any(d.content for d in deltas[first_call + 1:])  # text, then calls only
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for call in d.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": call.id or "", "name": "", "args": ""})
            entry["name"] += call.function.name or ""
            entry["args"] += call.function.arguments or ""
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_weather"]
    assert [json.loads(c["args"]) for c in calls.values()] == [{"city": "Paris"},
                                                               {"city": "Berlin"}]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    whole = ToolChatFormat(_job(), TokenTexts(tokenizer), frozenset(), _plan())
    body = whole.response([totals])
    message = body.choices[0].message
    assert message.content == TEXT
    assert message.tool_calls is not None
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [
        {"city": "Paris"}, {"city": "Berlin"}]
    assert body.choices[0].finish_reason == "tool_calls"


def test_a_sampled_tool_answer_reports_its_seed_in_every_chunk_and_its_body(
        tokenizer: PreTrainedTokenizerBase) -> None:
    """As every chat body and chunk does: the seed a sampled request sampled with."""
    job = dataclasses.replace(_job(), seed=7)
    streamed = ToolChatFormat(job, TokenTexts(tokenizer), frozenset(), _plan())
    totals = ChoiceTotals(drafter=None)
    chunks = list(streamed.opening_chunks())
    for event in _events(tokenizer, TEXT + CALL):
        totals.add(event)
        chunk = streamed.chunk(0, event, totals)
        if chunk is not None:
            chunks.append(chunk)
    assert len(chunks) > 2 and {c.seed for c in chunks} == {7}
    whole = ToolChatFormat(job, TokenTexts(tokenizer), frozenset(), _plan())
    assert whole.response([totals]).seed == 7


def test_responses_give_a_message_item_then_function_call_items(
        tokenizer: PreTrainedTokenizerBase) -> None:
    api = ResponsesRequest.model_validate({
        "model": "m", "input": "What is the weather in Paris?",
        "tools": [{"type": "function", **WEATHER["function"]}], "stream": True})
    chat = api.chat_request()
    plan = request_tools(chat)
    assert plan is not None and plan.calls_after_text
    events = _events(tokenizer, TEXT + CALL)
    streamed = ResponsesFormat(_job(), api, plan, sampling_params(chat))
    kinds, texts = [], []
    for event in events:
        for sse in streamed.feed(event.text, event.finished):
            data = json.loads(sse["data"])
            kinds.append(data["type"])
            if data["type"] == "response.output_text.delta":
                texts.append(data["delta"])
    kinds += [json.loads(e["data"])["type"] for e in streamed.close_items("completed")]
    assert "".join(texts) == TEXT
    added = [i for i, k in enumerate(kinds) if k == "response.output_item.added"]
    assert len(added) == 2 and kinds.index("response.output_text.delta") < added[1]
    assert kinds.index("response.function_call_arguments.delta") > added[1]
    assert [item["type"] for item in streamed.items] == ["message", "function_call"]

    totals = ChoiceTotals(drafter=None)
    for event in events:
        totals.add(event)
    body = ResponsesFormat(_job(), api, plan, sampling_params(chat)).response([totals])
    output = body.model_dump()["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert output[0]["content"][0]["text"] == TEXT
    assert output[1]["name"] == "get_weather"
    assert json.loads(output[1]["arguments"]) == {"city": "Paris"}


@pytest.fixture(scope="module")
def qwen_tokenizer() -> PreTrainedTokenizerBase:
    """Qwen2.5-Coder's tokenizer, where ``<tool_call>`` and ``</tool_call>`` are tokens."""
    if not model_store.QWEN_CODER_1_5B.pulled():
        pytest.skip(f"needs `specserve models pull {model_store.QWEN_CODER_1_5B.name}`")
    return AutoTokenizer.from_pretrained(model_store.QWEN_CODER_1_5B.directory())


def test_calls_after_text_written_with_the_tag_token_are_taken_and_parsed(
        qwen_tokenizer: PreTrainedTokenizerBase) -> None:
    """A call after text, where the tag is one token of its own (Qwen's ``<tool_call>``):
    the grammar takes the text and then the tag token, and the answer comes back as the
    text for content and the call for a tool call."""
    tags = tag_tokens(qwen_tokenizer)
    assert tags.open is not None and tags.close is not None
    answer = TEXT + CALL + "\n" + BERLIN
    ids = qwen_tokenizer.encode(answer, add_special_tokens=False)
    assert ids.count(tags.open) == 2 and ids.count(tags.close) == 2  # the tags as tokens
    eos = qwen_tokenizer.eos_token_id
    compiler = GrammarCompiler(qwen_tokenizer, len(qwen_tokenizer), eos,
                               stop_ids=frozenset({eos}))
    auto = _grammar(compiler, _plan())
    for taken in (TEXT, CALL, TEXT + CALL, answer):
        assert _takes(auto, qwen_tokenizer, taken), taken
    assert not _takes(auto, qwen_tokenizer, TEXT + CALL + " Done.")
    assert not _takes(_grammar(compiler, _plan(tool_choice="required")), qwen_tokenizer,
                      TEXT + CALL)

    streamed = ToolChatFormat(_job(), TokenTexts(qwen_tokenizer), frozenset(), _plan())
    totals = ChoiceTotals(drafter=None)
    chunks = []
    for event in _events(qwen_tokenizer, answer):
        totals.add(event)
        chunk = streamed.chunk(0, event, totals)
        if chunk is not None:
            chunks.append(chunk)
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == TEXT
    args: dict[int, str] = {}
    for d in deltas:
        for call in d.tool_calls or ():
            args[call.index] = args.get(call.index, "") + (call.function.arguments or "")
    assert [json.loads(a) for a in args.values()] == [{"city": "Paris"}, {"city": "Berlin"}]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_call_cut_by_the_length_limit_finishes_with_length(
        tokenizer: PreTrainedTokenizerBase) -> None:
    """A call the length limit cuts mid-arguments (after text, or forced) finishes with
    ``length``, never ``tool_calls``: its arguments are not whole JSON. Streamed and whole."""
    for plan, answer in ((_plan(), TEXT + CALL), (_plan(tool_choice="required"), CALL)):
        cut = _events(tokenizer, answer)[:-6]  # ends inside the arguments
        cut[-1] = dataclasses.replace(cut[-1], finish_reason=FinishReason.LENGTH)
        streamed = ToolChatFormat(_job(), TokenTexts(tokenizer), frozenset(), plan)
        totals = ChoiceTotals(drafter=None)
        chunks = []
        for event in cut:
            totals.add(event)
            chunk = streamed.chunk(0, event, totals)
            if chunk is not None:
                chunks.append(chunk)
        assert streamed.tool_calls() == 1 and not streamed.parsers[0].calls[0].done
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
            "length"]
        body = ToolChatFormat(_job(), TokenTexts(tokenizer), frozenset(), plan).response(
            [totals])
        assert body.choices[0].message.tool_calls is not None
        assert body.choices[0].finish_reason == "length"
