"""SIGTERM with N streams in flight on a real ``specserve serve`` process:
readiness turns 503 at once, new requests get 503 in OpenAI's format, the
streams in flight finish (or, past ``--shutdown-timeout``, end with an error
event), and the process exits 0. The time from SIGTERM to exit is measured."""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.conftest import Measure
from tests.reliability.support import (
    TINY,
    ServeProcess,
    assert_openai_error,
    serve,
    stream_text,
)

# a request that never ends must fail the test, not hang the suite
pytestmark = pytest.mark.timeout(300)

PROMPT = "Tell a very long story about the sea."


@dataclass
class Stream:
    """One streamed completion read in a thread."""

    url: str
    tokens: int
    events: list[str] = field(default_factory=list)
    status: int | None = None
    first: threading.Event = field(default_factory=threading.Event)
    ended_at: float | None = None
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        payload = {"model": TINY, "messages": [{"role": "user", "content": PROMPT}],
                   "max_tokens": self.tokens, "temperature": 0, "stream": True,
                   "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=300) as http, \
                http.stream("POST", f"{self.url}/v1/chat/completions", json=payload) as r:
            self.status = r.status_code
            if r.status_code != 200:
                self.first.set()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[len("data: "):])
                    self.first.set()
        self.ended_at = time.monotonic()

    def join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "a stream never ended"


def start_streams(url: str, count: int, tokens: int) -> list[Stream]:
    streams = [Stream(url, tokens).start() for _ in range(count)]
    for stream in streams:
        assert stream.first.wait(timeout=120), "a stream did not start"
        assert stream.status == 200, stream.events
    return streams


def check_refusals(url: str) -> float:
    """Readiness is 503 ``draining`` and new work gets 503 ``shutting_down``;
    returns how long readiness took to turn."""
    began = time.monotonic()
    while (ready := httpx.get(f"{url}/ready", timeout=10)).status_code != 503:
        assert time.monotonic() - began < 10, "readiness did not turn 503"
        time.sleep(0.02)
    flipped = time.monotonic() - began
    assert ready.json() == {"status": "draining"}
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi", "stream": True})]
    for path, body in bodies:
        refused = httpx.post(f"{url}{path}", json={"model": TINY, **body}, timeout=10)
        assert_openai_error(refused, 503, "shutting_down")
    return flipped


@dataclass(frozen=True)
class Termination:
    ready_503_s: float  # from SIGTERM to readiness 503
    exit_s: float  # from SIGTERM to the process's exit
    exit_after_last_stream_s: float  # from the last stream's end to the exit


def terminate(server: ServeProcess, streams: list[Stream], timeout: float) -> Termination:
    """SIGTERM, the checks while draining, and the exit (status 0)."""
    sent = time.monotonic()
    server.signal(signal.SIGTERM)
    flipped = check_refusals(server.url)
    assert any(s.thread is not None and s.thread.is_alive() for s in streams), \
        "every stream ended before the drain could be observed"
    assert server.process.wait(timeout=timeout) == 0
    exited = time.monotonic()
    for stream in streams:
        stream.join(timeout=30)
    last = max(s.ended_at or exited for s in streams)
    return Termination(round(flipped, 3), round(exited - sent, 2), round(exited - last, 2))


def test_sigterm_with_streams_in_flight(tiny_target_dir: Path, measure: Measure) -> None:
    count, tokens = 8, 160
    with serve(tiny_target_dir, "--shutdown-timeout", "60", "--max-tokens", "400") as server:
        streams = start_streams(server.url, count, tokens)
        ended = terminate(server, streams, timeout=90)
        server.assert_clean_log()
    texts = []
    for stream in streams:
        assert stream.events[-1] == "[DONE]", stream.events[-2:]
        usage = json.loads(stream.events[-2])["usage"]
        assert usage["completion_tokens"] == tokens
        texts.append(stream_text(stream.events[:-2])[0])
    assert len(set(texts)) == 1, "greedy streams of one prompt disagree"
    measure(streams=count, tokens_each=tokens, ready_503_after_s=ended.ready_503_s,
            sigterm_to_exit_s=ended.exit_s,
            exit_after_last_stream_s=ended.exit_after_last_stream_s)


@pytest.mark.slow
def test_sigterm_past_the_shutdown_timeout(tiny_long_context_dir: Path,
                                          measure: Measure) -> None:
    count, grace, tokens = 16, 1.0, 8000  # far more tokens than the grace allows
    flags = ("--shutdown-timeout", str(grace), "--max-tokens", str(tokens))
    with serve(tiny_long_context_dir, *flags) as server:
        streams = start_streams(server.url, count, tokens)
        ended = terminate(server, streams, timeout=60)
    for stream in streams:
        error = json.loads(stream.events[-1])["error"]
        assert error["code"] == "shutting_down" and "[DONE]" not in stream.events
    measure(streams=count, shutdown_timeout_s=grace, ready_503_after_s=ended.ready_503_s,
            sigterm_to_exit_s=ended.exit_s)
    assert ended.exit_s < grace + 10
