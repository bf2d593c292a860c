"""A stream shows life at once and keeps showing it until its first token, through the
official ``openai`` client against a real server: ``response.created`` and
``response.in_progress`` (chat: the role chunk) before the prompt is read, then a
heartbeat event after every interval without one. Clients such as Codex CLI time out on
events, not bytes, so the heartbeats are events (docs/api.md, "Streams").

No first token comes while the engine is not running: a request submitted before it
starts waits as one whose long prompt is being read does, for as long as the test
wants. The test starts the engine once two heartbeats have come, so it waits for events,
never for a time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from decoding.engine import Engine
from gateway.server import create_app
from runtime.runner.batched import BatchedLM
from tests.gateway.conftest import CHAT, TINY, live_server, openai_client, tiny_settings

HEARTBEAT_S = 0.05
HEARTBEATS_CEILING_S = 60.0  # two heartbeats of 0.05 s: only a silent stream waits this long


@pytest.fixture
def stopped_engine(tiny_target_dir: Path) -> Iterator[Engine]:
    """An engine of its own (the shared tiny engine keeps running), not yet started."""
    engine = Engine(BatchedLM.load(str(tiny_target_dir), dtype="float32"), {}, None)
    yield engine
    engine.shutdown()


@pytest.fixture
def client(stopped_engine: Engine) -> Iterator[openai.OpenAI]:
    app = create_app(tiny_settings(sse_heartbeat_interval=HEARTBEAT_S), engine=stopped_engine)
    with live_server(app) as url:
        yield openai_client(url)


def _until_heartbeats(stream: Any, engine: Engine, is_heartbeat: Any) -> list[Any]:
    """Every event of ``stream``; the engine starts once two heartbeats have come, or
    after HEARTBEATS_CEILING_S without them (then the test fails saying so, where the
    stream would otherwise wait for its first token to the suite's timeout)."""
    seen: list[Any] = []
    started = threading.Lock()

    def start() -> bool:
        if not started.acquire(blocking=False):
            return False
        engine.start()
        return True

    watchdog = threading.Timer(HEARTBEATS_CEILING_S, start)
    watchdog.start()
    try:
        for event in stream:
            seen.append(event)
            if sum(map(is_heartbeat, seen)) == 2:
                start()
    finally:
        watchdog.cancel()
    assert sum(map(is_heartbeat, seen)) >= 2, (
        f"fewer than two heartbeats in the {HEARTBEATS_CEILING_S:.0f} s before the engine "
        f"was started for them: {len(seen)} events")
    return seen


def test_responses_stream_opens_at_once_and_beats_until_the_first_token(
        client: openai.OpenAI, stopped_engine: Engine) -> None:
    stream = client.responses.create(model=TINY, input="Say hi.", max_output_tokens=4,
                                     temperature=0, stream=True)
    events = _until_heartbeats(stream, stopped_engine,
                               lambda e: e.type == "response.in_progress")
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    first_output = kinds.index("response.output_item.added")
    assert kinds[2:first_output] == ["response.in_progress"] * (first_output - 2)
    assert first_output >= 3  # a heartbeat came before the first token
    assert "response.output_text.delta" in kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert all(e.response.status == "in_progress" for e in events[:first_output])


def test_chat_stream_opens_with_the_role_and_beats_until_the_first_token(
        client: openai.OpenAI, stopped_engine: Engine) -> None:
    stream = client.chat.completions.create(model=TINY, messages=CHAT, max_tokens=4,
                                            temperature=0, stream=True)

    def is_heartbeat(chunk: Any) -> bool:
        delta = chunk.choices[0].delta
        return not (delta.role or delta.content or delta.tool_calls
                    or chunk.choices[0].finish_reason)

    chunks = _until_heartbeats(stream, stopped_engine, is_heartbeat)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    first_text = next(i for i, c in enumerate(chunks) if c.choices[0].delta.content)
    assert first_text >= 3 and all(map(is_heartbeat, chunks[1:first_text]))
    assert not any(c.choices[0].delta.role for c in chunks[1:])
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert len({c.id for c in chunks}) == 1
