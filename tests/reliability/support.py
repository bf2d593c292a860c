"""Helpers of the reliability suite: ``specserve serve`` as a real subprocess
(its process for RSS, its metrics port), SSE reading, OpenAI error checks and
Prometheus scrapes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import KEPT_VARIABLES, free_port, wait_for_status

REPO = Path(__file__).resolve().parents[2]
TINY = "tiny"
MIB = 1 << 20
ERROR_KEYS = {"message", "type", "param", "code"}
START_TIMEOUT_S = 120.0


# -- OpenAI error format ---------------------------------------------------------------


def error_problem(status: int, body: bytes, content_type: str) -> str | None:
    """Why an error response is not in OpenAI's format, or None when it is."""
    if not content_type.startswith("application/json"):
        return f"{status} with content-type {content_type!r}"
    try:
        payload = json.loads(body)
    except ValueError:
        return f"{status} with a body that is not JSON: {body[:200]!r}"
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or set(error) != ERROR_KEYS or set(payload) != {"error"}:
        return f"{status} with a body not in OpenAI's error format: {body[:300]!r}"
    if not isinstance(error["message"], str) or not error["message"]:
        return f"{status} with an empty message"
    if not isinstance(error["type"], str):
        return f"{status} with a non-string type"
    if not all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")):
        return f"{status} with a param or code that is neither a string nor null"
    return None


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None,
                        param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text[:500])
    problem = error_problem(status, response.content, response.headers.get("content-type", ""))
    assert problem is None, problem
    error: dict[str, Any] = response.json()["error"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


# -- server-sent events ----------------------------------------------------------------


def sse_data(text: str) -> list[str]:
    """The ``data:`` payloads of an event stream, in order."""
    return [line[len("data: "):] for line in sse_lines(text) if line.startswith("data: ")]


def sse_lines(text: str) -> list[str]:
    """An event stream's lines: split at CR, LF or CRLF only, as SSE does (not at the
    other line breaks ``str.splitlines`` knows, such as U+2028 inside JSON strings)."""
    return re.split(r"\r\n|\r|\n", text)


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """``(event name or None, data)`` of each event of a stream, in order."""
    events: list[tuple[str | None, str]] = []
    name: str | None = None
    data: list[str] = []
    for line in [*sse_lines(text), ""]:
        if not line:
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:"):].removeprefix(" "))
    return events


def stream_text(events: Sequence[str]) -> dict[int, str]:
    """Text per choice index of a finished chat or completion stream."""
    out: dict[int, str] = {}
    for data in events:
        if data == "[DONE]":
            continue
        for choice in json.loads(data).get("choices", []):
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or {}).get("content") or ""
            out[choice["index"]] = out.get(choice["index"], "") + piece
    return out


# -- Prometheus --------------------------------------------------------------------------


def scrape(metrics_url: str) -> dict[str, float]:
    """Every sample of a /metrics page, summed over labels, by sample name."""
    text = httpx.get(f"{metrics_url}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def is_idle(url: str) -> bool:
    body = httpx.get(f"{url}/ready", timeout=5).json()
    return body.get("running") == 0 and body.get("waiting") == 0


# -- a real server process -------------------------------------------------------------


@dataclass
class ServeProcess:
    """``specserve serve`` on loopback ports, with its log in a file."""

    process: subprocess.Popen[str]
    url: str
    metrics_url: str
    log: IO[str]

    @property
    def ps(self) -> psutil.Process:
        return psutil.Process(self.process.pid)

    def rss(self) -> int:
        return int(self.ps.memory_info().rss)

    def log_text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def assert_clean_log(self) -> None:
        """No traceback and no unhandled error in the server's log."""
        log = self.log_text()
        for marker in ("Traceback", "unhandled error"):
            at = log.find(marker)
            assert at < 0, f"the server logged {marker!r}:\n{log[max(0, at - 500):at + 3000]}"

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)


def serve_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SPECSERVE_") or k in KEPT_VARIABLES}
    env.update(extra)
    return env


@contextmanager
def serve(model_dir: Path, *flags: str, env: dict[str, str] | None = None,
          start_timeout: float = START_TIMEOUT_S) -> Iterator[ServeProcess]:
    """Run ``specserve serve --target model_dir`` until it is ready; kill it at the end."""
    with serve_many([flags], model_dir, env, start_timeout) as (server,):
        yield server


@contextmanager
def serve_many(flag_sets: Sequence[Sequence[str]], model_dir: Path,
               env: dict[str, str] | None = None, start_timeout: float = START_TIMEOUT_S
               ) -> Iterator[list[ServeProcess]]:
    """Several servers, started side by side (their start-ups overlap)."""
    with ExitStack() as stack:
        servers = [stack.enter_context(_spawn(model_dir, flags, env)) for flags in flag_sets]
        for server in servers:
            _wait_ready(server, start_timeout)
        yield servers


@contextmanager
def _spawn(model_dir: Path, flags: Sequence[str], env: dict[str, str] | None
           ) -> Iterator[ServeProcess]:
    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-m", "specserve.cli", "serve", "--target", str(model_dir),
               "--served-model-name", TINY, "--host", "127.0.0.1", "--port", str(port),
               "--metrics-port", str(metrics_port), "--threads", "1", "--log-level", "info",
               *flags]
    with tempfile.TemporaryFile(mode="w+") as log:  # a file, not a pipe: never blocks
        process = subprocess.Popen(command, cwd=REPO, env=env or serve_env(), stdout=log,
                                   stderr=subprocess.STDOUT, text=True)
        try:
            yield ServeProcess(process, f"http://127.0.0.1:{port}",
                               f"http://127.0.0.1:{metrics_port}", log)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)


def _wait_ready(server: ServeProcess, timeout: float = START_TIMEOUT_S) -> None:
    wait_for_status(f"{server.url}/ready", server.process, timeout,
                    lambda: server.log_text()[-4000:])


@dataclass
class RssSampler:
    """The peak RSS of a process, sampled in a thread while in use."""

    process: psutil.Process
    interval: float = 0.02
    peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> RssSampler:
        self.peak = int(self.process.memory_info().rss)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.peak = max(self.peak, int(self.process.memory_info().rss))
            except psutil.Error:
                return


def settled_rss(server: ServeProcess, seconds: float = 2.0) -> int:
    """The lowest RSS over a short quiet period (after work ends, allocators settle)."""
    lowest = server.rss()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)
        lowest = min(lowest, server.rss())
    return lowest


def mib(size: int) -> str:
    return f"{size / MIB:.1f} MiB"
