"""A real uvicorn server on the tiny model, driven by the official ``openai`` client."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from decoding.engine import Engine
from gateway.server import create_app
from observability.telemetry import Telemetry
from runtime.runner.causal_lm import CausalLM
from tests.gateway.conftest import (
    CHAT,
    TINY,
    live_server,
    metric_total,
    openai_client,
    tiny_settings,
    wait_until,
)
from tests.gateway.test_inprocess import FailingDrafter


@pytest.fixture(scope="module")
def client(tiny_url: str) -> openai.OpenAI:
    return openai_client(tiny_url)


def stream_chat(client: openai.OpenAI, **kwargs: Any) -> list[Any]:
    return list(client.chat.completions.create(model=TINY, messages=CHAT, stream=True,
                                               **kwargs))


def texts_by_index(chunks: list[Any]) -> dict[int, str]:
    out: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            out[choice.index] = out.get(choice.index, "") + (piece or "")
    return out


def test_streamed_chat_equals_whole_chat(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"max_tokens": 10, "temperature": 0.9, "seed": 5}
    whole = client.chat.completions.create(model=TINY, messages=CHAT, **kwargs)
    chunks = stream_chat(client, **kwargs)
    assert texts_by_index(chunks) == {0: whole.choices[0].message.content}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks]
    assert finishes[-1] == whole.choices[0].finish_reason == "length"
    assert finishes[:-1] == [None] * (len(chunks) - 1)
    assert chunks[-1].model_extra["speculation"]["rounds"] >= 1
    assert whole.model_extra["speculation"]["drafter"] == "ngram"


def test_n_choices_stream_interleaved(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 2}
    whole = client.chat.completions.create(model=TINY, messages=CHAT, **kwargs)
    chunks = stream_chat(client, **kwargs)
    assert all(len(c.choices) == 1 for c in chunks)
    order = [c.choices[0].index for c in chunks]
    assert set(order) == {0, 1} and order != sorted(order)  # interleaved, not one after another
    streamed = texts_by_index(chunks)
    assert streamed == {c.index: c.message.content for c in whole.choices}
    assert streamed[0] != streamed[1]  # the choice index is part of the sampling key
    assert [c.choices[0].finish_reason for c in chunks].count("length") == 2


def tokens_by_index(chunks: list[Any]) -> dict[int, int]:
    """Tokens streamed per choice (requested with logprobs: one entry per token)."""
    out: dict[int, int] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            out[choice.index] = out.get(choice.index, 0) + len(choice.logprobs.content
                                                                if choice.logprobs else ())
    return out


def finishes_by_index(chunks: list[Any]) -> dict[int, str]:
    return {choice.index: choice.finish_reason for chunk in chunks for choice in chunk.choices
            if choice.finish_reason is not None}


def test_every_choice_honours_max_tokens(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"temperature": 1.0, "seed": 3, "n": 2, "logprobs": True}
    limit = 6
    longer = client.chat.completions.create(model=TINY, messages=CHAT, max_tokens=3 * limit,
                                            **kwargs)
    assert all(len(c.logprobs.content) > limit for c in longer.choices)  # both would go on
    whole = client.chat.completions.create(model=TINY, messages=CHAT, max_tokens=limit,
                                           **kwargs)
    assert [(len(c.logprobs.content), c.finish_reason) for c in whole.choices] == \
        [(limit, "length")] * 2
    assert whole.usage.completion_tokens == 2 * limit
    chunks = stream_chat(client, max_tokens=limit, **kwargs)
    assert tokens_by_index(chunks) == {0: limit, 1: limit}
    assert finishes_by_index(chunks) == {0: "length", 1: "length"}


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(model=TINY, prompt="Once upon a time", max_tokens=8,
                                      temperature=1.0, seed=seed)
        return r.choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_stop_strings(client: openai.OpenAI) -> None:
    base: dict[str, Any] = {"model": TINY, "prompt": "The weather", "max_tokens": 12,
                            "temperature": 0}
    whole = client.completions.create(**base, logprobs=1).choices[0]
    full, tokens = whole.text, whole.logprobs.tokens
    # a stop string that spans a token boundary: its start must be held back until the
    # next token shows whether the stop completes
    i = next(i for i in range(len(tokens) // 2, len(tokens) - 1)
             if tokens[i].strip() and tokens[i + 1].strip())
    stop = tokens[i][-2:] + tokens[i + 1][:2]
    assert len(stop) > 2
    expected = full[: full.index(stop)]
    cut = client.completions.create(**base, stop=[stop, "never-there"]).choices[0]
    assert (cut.text, cut.finish_reason) == (expected, "stop")
    for speculation in ({"enabled": True}, {"enabled": False}):  # off: one token a round
        chunks = list(client.completions.create(**base, stop=stop, stream=True,
                                                extra_body={"speculation": speculation}))
        assert texts_by_index(chunks) == {0: expected}
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "logprobs": True,
                              "top_logprobs": 3}
    whole = client.chat.completions.create(model=TINY, messages=CHAT, **kwargs)
    choice = whole.choices[0]
    content = choice.logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == choice.message.content
    for entry in content:
        assert bytes(entry.bytes).decode() == entry.token
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy picks the top token
    streamed = [e for c in stream_chat(client, **kwargs) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == \
        [(e.token, round(e.logprob, 4)) for e in content]


def test_completion_logprobs_legacy_format(client: openai.OpenAI) -> None:
    r = client.completions.create(model=TINY, prompt="Hello", max_tokens=5, temperature=0.5,
                                  seed=1, logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == choice.text
    for token, offset, top, value in zip(lp.tokens, lp.text_offset, lp.top_logprobs,
                                         lp.token_logprobs, strict=True):
        assert choice.text[offset:offset + len(token)] == token
        assert isinstance(top, dict) and len(top) <= 2 and value <= 0
    chunks = list(client.completions.create(model=TINY, prompt="Hello", max_tokens=5,
                                            temperature=0.5, seed=1, logprobs=2, stream=True))
    offsets = [o for c in chunks for o in (c.choices[0].logprobs.text_offset
                                           if c.choices[0].logprobs else [])]
    assert offsets == lp.text_offset  # offsets keep running across chunks


def test_usage_in_stream(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=TINY, messages=CHAT, max_tokens=5)
    chunks = stream_chat(client, max_tokens=5, stream_options={"include_usage": True})
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == 5 and last.usage.total_tokens == whole.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert set(last.model_extra["speculation"]) == {"drafter", "rounds", "draft_tokens",
                                                    "accepted_tokens", "acceptance_rate"}
    without = stream_chat(client, max_tokens=2)
    assert all(c.choices for c in without)


def test_usage_in_stream_counts_every_choice(client: openai.OpenAI) -> None:
    one = client.chat.completions.create(model=TINY, messages=CHAT, max_tokens=1)
    chunks = stream_chat(client, max_tokens=5, n=2, temperature=1.0, seed=4, logprobs=True,
                         stream_options={"include_usage": True})
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
    last = chunks[-1]
    assert last.choices == []
    tokens = tokens_by_index(chunks)
    assert set(tokens) == {0, 1} and all(tokens.values())
    assert last.usage.completion_tokens == tokens[0] + tokens[1]
    assert last.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_echo(client: openai.OpenAI) -> None:
    prompt = "Echo this prompt:"
    whole = client.completions.create(model=TINY, prompt=prompt, max_tokens=3, temperature=0,
                                      echo=True)
    plain = client.completions.create(model=TINY, prompt=prompt, max_tokens=3, temperature=0)
    assert whole.choices[0].text == prompt + plain.choices[0].text
    chunks = list(client.completions.create(model=TINY, prompt=prompt, max_tokens=3,
                                            temperature=0, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(prompt)
    assert texts_by_index(chunks) == {0: whole.choices[0].text}


def test_speculation_per_request(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": TINY, "prompt": "one two three one two three one",
                              "max_tokens": 12, "temperature": 0}
    plain = client.completions.create(**kwargs, extra_body={"speculation": {"enabled": False}})
    drafted = client.completions.create(
        **kwargs, extra_body={"speculation": {"drafter": "draft", "max_draft_tokens": 3}})
    assert drafted.choices[0].text == plain.choices[0].text  # lossless under greedy
    assert plain.model_extra["speculation"]["draft_tokens"] == 0
    stats = drafted.model_extra["speculation"]
    assert stats["drafter"] == "draft" and stats["draft_tokens"] > 0
    assert stats["rounds"] < 12 or stats["accepted_tokens"] == 0


def test_errors_through_the_sdk(client: openai.OpenAI, tiny_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as tools:
        client.chat.completions.create(model=TINY, messages=CHAT, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}])
    assert tools.value.param == "tools"
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=TINY, messages=CHAT,
                                       response_format={"type": "yaml"})  # type: ignore[typeddict-item]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="top_k"):
        client.completions.create(model=TINY, prompt="x", extra_body={"top_k": -1})


def test_error_after_stream_began_is_an_api_error(tiny_target: CausalLM) -> None:
    engine = Engine(tiny_target, {"boom": FailingDrafter()}, default_drafter="boom")
    engine.start()
    try:
        with live_server(create_app(tiny_settings(), engine=engine)) as url:
            stream = openai_client(url).chat.completions.create(
                model=TINY, messages=CHAT, max_tokens=5, stream=True)
            received = []
            with pytest.raises(openai.APIError, match="model failed"):
                for chunk in stream:
                    received.append(chunk)
            assert received and received[0].choices[0].delta.role == "assistant"
    finally:
        engine.shutdown()


def test_concurrent_streams_all_progress(tiny_target: CausalLM) -> None:
    """Four streams that wait together are decoded together: their rounds share forward
    passes (the batch size the metrics export), and every stream gets its chunks."""
    engine = Engine(tiny_target)  # held: the four requests wait in its queue until started
    telemetry = Telemetry(TINY)
    app = create_app(tiny_settings(), engine=engine, telemetry=telemetry)
    chunks: dict[int, list[str]] = {}
    try:
        with live_server(app) as url:
            client = openai_client(url)

            def run(i: int) -> None:
                for chunk in client.completions.create(
                        model=TINY, prompt=f"Stream number {i}", max_tokens=16,
                        temperature=0, stream=True):
                    chunks.setdefault(i, []).append(chunk.choices[0].text if chunk.choices
                                                    else "")

            threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            assert wait_until(lambda: engine.num_waiting == 4, timeout=60)
            engine.start()
            for t in threads:
                t.join(timeout=120)
    finally:
        engine.shutdown()
    assert sorted(chunks) == [0, 1, 2, 3] and all(len(c) >= 2 for c in chunks.values())
    in_fours = (metric_total(telemetry.metrics, "specserve_batch_size_bucket", le="4.0")
                - metric_total(telemetry.metrics, "specserve_batch_size_bucket", le="2.0"))
    assert in_fours >= 4, in_fours  # a round of each stream verified beside the other three
    assert engine.num_running == 0


@pytest.fixture
def stalled_url(tiny_target: CausalLM) -> Iterator[str]:
    """A server whose engine is never started: requests wait in its queue."""
    engine = Engine(tiny_target)
    with live_server(create_app(tiny_settings(sse_ping_interval=0.2), engine=engine)) as url:
        yield url


def test_keep_alive_comments_while_queued(stalled_url: str) -> None:
    payload = {"model": TINY, "messages": CHAT, "stream": True}
    lines: list[str] = []
    with httpx.Client(timeout=10) as http, \
            http.stream("POST", f"{stalled_url}/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            lines.append(line)
            if sum(1 for x in lines if x.startswith(":")) >= 2:
                break
    data = [json.loads(line.removeprefix("data:")) for line in lines if line.startswith("data:")]
    assert data and data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert not any(chunk["choices"][0]["delta"].get("content") for chunk in data)  # no token


def test_a_seed_fixes_the_text_whatever_drafts_it(client: openai.OpenAI) -> None:
    """Speculation off, each drafter, repeated, concurrent, streamed: one text per seed.
    An unseeded request reports the seed it drew, and replaying it gives its text."""
    kwargs: dict[str, Any] = {"model": TINY, "messages": CHAT, "max_tokens": 16,
                              "temperature": 1.0, "top_p": 0.95, "seed": 7}

    def text(**extra: Any) -> str:
        reply = client.chat.completions.create(**{**kwargs, **extra})
        assert reply.model_extra["seed"] == extra.get("seed", 7)
        return str(reply.choices[0].message.content)

    plain = text(extra_body={"speculation": {"enabled": False}})
    ways = [{}, {}, {"extra_body": {"speculation": {"drafter": "draft"}}},
            {"extra_body": {"speculation": {"drafter": "ngram", "max_draft_tokens": 2}}}]
    assert [text(**way) for way in ways] == [plain] * len(ways)
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda way: text(**way), ways)) == [plain] * len(ways)
    assert texts_by_index(stream_chat(client, **{k: v for k, v in kwargs.items()
                                                 if k not in ("model", "messages")})) \
        == {0: plain}
    assert text(seed=8) != plain
    two = client.chat.completions.create(**{**kwargs, "n": 2})
    assert two.choices[0].message.content == plain != two.choices[1].message.content

    drawn = client.chat.completions.create(**{**kwargs, "seed": None})
    seed = drawn.model_extra["seed"]
    assert isinstance(seed, int)
    assert text(seed=seed) == drawn.choices[0].message.content
    greedy = client.chat.completions.create(**{**kwargs, "temperature": 0})
    assert "seed" not in greedy.model_extra
