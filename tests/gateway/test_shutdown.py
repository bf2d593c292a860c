"""``specserve serve`` as a real process: SIGTERM drains in-flight streams,
refuses new work with 503 meanwhile, and the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx

from tests.conftest import KEPT_VARIABLES, free_port, wait_for_status
from tests.gateway.conftest import CHAT

REPO = Path(__file__).resolve().parents[2]
STREAM_TOKENS = 400  # long enough to still be running while the test probes


def _read(log: IO[str]) -> str:
    log.seek(0)
    return log.read()


@contextmanager
def run_server(model_dir: Path, shutdown_timeout: float, max_tokens: int = STREAM_TOKENS
               ) -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")
           or k in KEPT_VARIABLES}
    env["SPECSERVE_SHUTDOWN_TIMEOUT"] = str(shutdown_timeout)
    with tempfile.TemporaryFile(mode="w+") as log:  # a file, not a pipe: never blocks
        proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli", "serve", "--target", str(model_dir),
             "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
             "--threads", "1", "--log-level", "info", "--max-tokens", str(max_tokens)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_status(f"{url}/ready", proc, 120, lambda: _read(log))
            yield proc, url
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def start_stream(url: str, tokens: int = STREAM_TOKENS) -> tuple[threading.Thread, list[str]]:
    """A long stream read in a thread; returns once its first chunk arrived."""
    payload = {"model": "tiny", "messages": CHAT, "max_tokens": tokens,
               "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    first_chunk = threading.Event()
    events: list[str] = []

    def consume() -> None:
        with httpx.Client(timeout=120) as http, \
                http.stream("POST", f"{url}/v1/chat/completions", json=payload) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_chunk.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert first_chunk.wait(timeout=60)
    return reader, events


def test_sigterm_drains_then_exits_zero(tiny_target_dir: Path) -> None:
    with run_server(tiny_target_dir, shutdown_timeout=60) as (proc, url):
        reader, events = start_stream(url)
        proc.send_signal(signal.SIGTERM)
        check_draining(url, reader)
        reader.join(timeout=120)
        assert proc.wait(timeout=60) == 0
    assert events[-1] == "[DONE]"
    usage: dict[str, Any] = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == STREAM_TOKENS
    finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"]]
    assert finishes[-1] == "length"


def test_streams_past_the_shutdown_timeout_end_with_an_error(
        tiny_long_context_dir: Path) -> None:
    # far more tokens than the 0.3 s grace allows on any machine (a 512-token context
    # does not: a fast machine finished it first)
    with run_server(tiny_long_context_dir, shutdown_timeout=0.3, max_tokens=12000) \
            as (proc, url):
        reader, events = start_stream(url, tokens=12000)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        reader.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - started < 10
    error = json.loads(events[-1])["error"]
    assert error["code"] == "shutting_down"
    assert "[DONE]" not in events


def check_draining(url: str, reader: threading.Thread) -> None:
    """Readiness turns 503 and new requests are refused while a stream drains."""

    def ready_status() -> int:
        return httpx.get(f"{url}/ready", timeout=5).status_code

    deadline = time.monotonic() + 10
    while ready_status() != 503:
        assert time.monotonic() < deadline, "readiness did not turn 503 after SIGTERM"
        time.sleep(0.05)
    refused = httpx.post(f"{url}/v1/chat/completions", timeout=5,
                         json={"model": "tiny", "messages": CHAT, "max_tokens": 1})
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "shutting_down"
    assert reader.is_alive(), "the stream ended before the drain could be observed"
