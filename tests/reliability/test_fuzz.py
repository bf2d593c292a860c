"""Schema-based fuzzing of every endpoint of a real ``specserve serve`` process,
driven by the OpenAPI document it serves (schemathesis + hypothesis).

Every case must get a documented status, content type, headers and body (JSON,
or server-sent events whose every event matches the documented event schema),
never a 5xx; schema-invalid bodies must be refused with a 4xx; every refusal
must be in OpenAI's error format. Positive cases name the served model, so that
schema-valid requests reach the model (small ``--max-tokens`` keeps them quick).
Failures are collected per operation, mode and check rather than stopping at the
first, so that one run reports them all; the server must still be healthy and
its log free of tracebacks afterwards. A shorter run with API keys checks that
every /v1 operation enforces the bearer scheme the document declares.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok
from schemathesis.core.transport import Response
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from decoding.engine import Engine
from gateway.server import create_app
from gateway.wire.response_events import END_EVENTS
from tests.gateway.conftest import live_server, tiny_settings
from tests.reliability.conftest import Measure
from tests.reliability.support import (
    TINY,
    ServeProcess,
    error_problem,
    is_idle,
    serve,
    sse_data,
    sse_events,
    wait_for,
)

# a request that never ends must fail the test, not hang the suite
pytestmark = pytest.mark.timeout(300)

POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
CHAT, TEXT = "POST /v1/chat/completions", "POST /v1/completions"
MODEL = "GET /v1/models/{model_id}"
FIXED = ("GET /health", "GET /ready", "GET /v1/models")  # no inputs: one case each
RESPONSES = "POST /v1/responses"  # typed event streams, without [DONE]
TOKENIZE, DETOKENIZE = "POST /tokenize", "POST /detokenize"
# (operation, mode, cases): a path parameter that is any string has no negative cases.
FAST_PLAN = [(CHAT, POSITIVE, 200), (CHAT, NEGATIVE, 100), (TEXT, POSITIVE, 200),
             (TEXT, NEGATIVE, 100), (RESPONSES, POSITIVE, 120), (RESPONSES, NEGATIVE, 60),
             (TOKENIZE, POSITIVE, 60), (TOKENIZE, NEGATIVE, 30), (DETOKENIZE, POSITIVE, 30),
             (DETOKENIZE, NEGATIVE, 20), (MODEL, POSITIVE, 20),
             *((op, POSITIVE, 1) for op in FIXED)]
SLOW_PLAN = [(CHAT, POSITIVE, 800), (CHAT, NEGATIVE, 400), (TEXT, POSITIVE, 800),
             (TEXT, NEGATIVE, 400), (RESPONSES, POSITIVE, 600), (RESPONSES, NEGATIVE, 300),
             (TOKENIZE, POSITIVE, 200), (TOKENIZE, NEGATIVE, 100),
             (DETOKENIZE, POSITIVE, 100), (DETOKENIZE, NEGATIVE, 50),
             (MODEL, POSITIVE, 50), *((op, POSITIVE, 1) for op in FIXED)]
KEYED_PLAN = [(CHAT, POSITIVE, 20), (TEXT, POSITIVE, 20), (RESPONSES, POSITIVE, 10),
              (TOKENIZE, POSITIVE, 5), (DETOKENIZE, POSITIVE, 5),
              (MODEL, POSITIVE, 5), *((op, POSITIVE, 1) for op in FIXED)]
KEY = "fuzz-key"
SERVER_FLAGS = ("--max-tokens", "4", "--max-prompt-tokens", "64", "--max-body-bytes", "65536",
                "--request-timeout", "30", "--log-level", "warning")
CASE_TIMEOUT_S = 60
MAX_STREAM_EVENTS = 1000  # far above n=16 choices x 4 tokens; schemathesis reads 20 by default


def openai_error_format(ctx: Any, response: Response, case: Any) -> None:
    """Every 4xx/5xx body is ``{"error": {"message", "type", "param", "code"}}``."""
    if response.status_code >= 400:
        content_type = (response.headers.get("content-type") or [""])[0]
        problem = error_problem(response.status_code, response.content, content_type)
        if problem is not None:
            raise AssertionError(problem)


def stream_is_terminated(ctx: Any, response: Response, case: Any) -> None:
    """A 200 event stream ends with ``[DONE]`` or with the error that ended it; a
    /v1/responses stream is typed events instead (see ``typed_stream_problem``)."""
    content_type = (response.headers.get("content-type") or [""])[0]
    if response.status_code != 200 or not content_type.startswith("text/event-stream"):
        return
    if response.stream_cut_short:
        raise AssertionError(f"the stream was still going after {MAX_STREAM_EVENTS} events "
                             f"or {CASE_TIMEOUT_S} s")
    text = response.content.decode()
    if str(response.request.url).endswith("/v1/responses"):
        problem = typed_stream_problem(sse_events(text))
        if problem is not None:
            raise AssertionError(problem)
        return
    events = sse_data(text)
    if not events:
        raise AssertionError("an empty event stream")
    last = events[-1]
    if last != "[DONE]" and "error" not in json.loads(last):
        raise AssertionError(f"the stream ended with neither [DONE] nor an error: {last[:200]}")


def typed_stream_problem(events: Sequence[tuple[str | None, str]]) -> str | None:
    """What is wrong with a Responses stream, or None: every event's ``event:`` line
    is its data's ``type``, ``sequence_number`` counts from 0, it starts with
    ``response.created`` and ends with exactly one end event (no ``[DONE]``). The
    events' shapes are checked against the document by ``response_schema_conformance``."""
    if not events:
        return "an empty event stream"
    types = []
    for number, (name, data) in enumerate(events):
        if data == "[DONE]":
            return "a Responses stream sent [DONE]"
        payload = json.loads(data)
        if not isinstance(payload, dict) or payload.get("type") != name:
            return f"event {number}: the event line {name!r} is not the data's type: {data[:200]}"
        if payload.get("sequence_number") != number:
            return f"event {number} has sequence_number {payload.get('sequence_number')!r}"
        types.append(name)
    if types[0] != "response.created":
        return f"the stream began with {types[0]}"
    ends = [i for i, kind in enumerate(types) if kind in END_EVENTS]
    if ends != [len(types) - 1]:
        return f"end events at {ends} of {len(types)} events: {types[-3:]}"
    return None


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance, negative_data_rejection,
          openai_error_format, stream_is_terminated]


@dataclass
class Tally:
    """Cases, statuses and failures per (operation, mode)."""

    cases: Counter[tuple[str, str]] = field(default_factory=Counter)
    statuses: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    failures: dict[tuple[str, str, str], list[str]] = field(default_factory=dict)

    def fail(self, label: str, mode: str, exc: BaseException, curl: str) -> None:
        failures = getattr(exc, "exceptions", None) or [exc]
        for failure in failures:
            title = getattr(failure, "title", None) or type(failure).__name__
            self.failures.setdefault((label, mode, str(title)), []).append(
                f"{str(failure)[:600]}\n    {curl}")

    def summary(self) -> dict[str, str]:
        out = {}
        for (label, mode), count in sorted(self.cases.items()):
            statuses = {s: n for (lb, md, s), n in self.statuses.items()
                        if (lb, md) == (label, mode)}
            failed = sum(len(v) for (lb, md, _), v in self.failures.items()
                         if (lb, md) == (label, mode))
            out[f"{label} [{mode}]"] = f"{count} cases, {failed} failed, statuses {statuses}"
        return out


@dataclass(frozen=True)
class Setup:
    """How cases are sent and judged."""

    derandomize: bool
    headers: dict[str, str] = field(default_factory=dict)
    checks: tuple[Any, ...] = tuple(CHECKS)


def fuzz_operation(operation: Any, mode: GenerationMode, examples: int, tally: Tally,
                   session: requests.Session, setup: Setup) -> None:
    label, name = operation.label, mode.value

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None,
              derandomize=setup.derandomize, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        if mode is POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = TINY  # a schema-valid request for the served model
        response = case.call(session=session, headers=setup.headers, timeout=CASE_TIMEOUT_S)
        tally.cases[(label, name)] += 1
        tally.statuses[(label, name, response.status_code)] += 1
        try:
            case.validate_response(response, checks=list(setup.checks), headers=setup.headers,
                                   transport_kwargs={"headers": setup.headers,
                                                     "timeout": CASE_TIMEOUT_S})
        except (FailureGroup, AssertionError) as exc:
            tally.fail(label, name, exc, case.as_curl_command())

    run()


def fuzz(url: str, plan: Sequence[tuple[str, GenerationMode, int]], setup: Setup) -> Tally:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    schema.config.max_stream_events = MAX_STREAM_EVENTS  # read (and check) whole streams
    operations = {}
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), f"an operation is not valid OpenAPI: {result}"
        operations[result.ok().label] = result.ok()
    assert set(operations) == {CHAT, TEXT, MODEL, RESPONSES, TOKENIZE, DETOKENIZE, *FIXED}, \
        sorted(operations)
    tally = Tally()
    with requests.Session() as session:
        for label, mode, examples in plan:
            fuzz_operation(operations[label], mode, examples, tally, session, setup)
    return tally


@pytest.fixture(scope="module")
def fuzz_server(tiny_target_dir: Path) -> Iterator[ServeProcess]:
    with serve(tiny_target_dir, *SERVER_FLAGS) as server:
        yield server


def check_still_serving(server: ServeProcess) -> None:
    assert server.process.poll() is None, "the server exited"
    assert wait_for(lambda: is_idle(server.url), timeout=30), "work was left behind"
    reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": TINY, "prompt": "Still there?", "max_tokens": 3})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    server.assert_clean_log()


def run_and_report(url: str, plan: Sequence[tuple[str, GenerationMode, int]], setup: Setup,
                   measure: Measure) -> None:
    tally = fuzz(url, plan, setup)
    total = sum(tally.cases.values())
    failed = sum(len(v) for v in tally.failures.values())
    measure(cases=total, failures=failed, **tally.summary())
    detail = "\n".join(f"{key}: {len(items)} case(s), e.g.\n{items[0]}"
                       for key, items in tally.failures.items())
    assert not tally.failures, detail
    assert total >= sum(n for _, _, n in plan) * 0.9, "hypothesis ran fewer cases than planned"


def test_fuzz_every_endpoint(fuzz_server: ServeProcess, measure: Measure) -> None:
    run_and_report(fuzz_server.url, FAST_PLAN, Setup(derandomize=True), measure)
    check_still_serving(fuzz_server)


@pytest.mark.slow
def test_fuzz_every_endpoint_long(fuzz_server: ServeProcess, measure: Measure) -> None:
    run_and_report(fuzz_server.url, SLOW_PLAN, Setup(derandomize=False), measure)
    check_still_serving(fuzz_server)


def test_fuzz_with_api_keys(tiny_engine: Engine, measure: Measure) -> None:
    """With keys configured, the document declares the bearer scheme, and every /v1
    operation refuses a request without the key, or with a wrong one, with a 401."""
    settings = tiny_settings(api_keys=[KEY], max_tokens=4, max_prompt_tokens=64)
    setup = Setup(derandomize=True, headers={"Authorization": f"Bearer {KEY}"},
                  checks=(*CHECKS, ignored_auth))
    with live_server(create_app(settings, engine=tiny_engine)) as url:
        run_and_report(url, KEYED_PLAN, setup, measure)
        refused = httpx.get(f"{url}/v1/models", timeout=10)
        assert refused.status_code == 401 and error_problem(
            401, refused.content, refused.headers["content-type"]) is None


def fake_response(status: int, body: bytes, content_type: str,
                  path: str = "/v1/completions") -> Response:
    request = requests.Request("POST", f"http://127.0.0.1{path}").prepare()
    return Response(status_code=status, headers={"content-type": [content_type]},
                    content=body, request=request, elapsed=0.01, verify=True)


@pytest.mark.parametrize(("status", "body", "content_type"), [
    (400, b'{"detail": "bad"}', "application/json"),
    (404, b"Not Found", "text/plain"),
    (500, b'{"error": {"message": "x", "type": "t"}}', "application/json"),
    (200, b'data: {"id": "x"}\n\n', "text/event-stream"),
    (200, b"", "text/event-stream"),
])
def test_custom_checks_catch_what_they_are_for(status: int, body: bytes,
                                               content_type: str) -> None:
    response = fake_response(status, body, content_type)
    with pytest.raises(AssertionError):
        openai_error_format(None, response, None)
        stream_is_terminated(None, response, None)


def test_custom_checks_pass_good_responses() -> None:
    error = b'{"error": {"message": "m", "type": "t", "param": null, "code": "c"}}'
    openai_error_format(None, fake_response(400, error, "application/json"), None)
    done = b'data: {"id": "x"}\n\ndata: [DONE]\n\n'
    stream_is_terminated(None, fake_response(200, done, "text/event-stream"), None)


def typed(*kinds: str, numbers: Sequence[int] | None = None, names: Sequence[str] = ()) -> bytes:
    """A Responses stream of these event types (``names`` overrides the event lines)."""
    out = []
    for i, kind in enumerate(kinds):
        name = names[i] if i < len(names) else kind
        number = numbers[i] if numbers is not None else i
        out.append(f"event: {name}\ndata: "
                   + json.dumps({"type": kind, "sequence_number": number}) + "\n\n")
    return "".join(out).encode()


GOOD_TYPED = ("response.created", "response.in_progress", "response.completed")


@pytest.mark.parametrize("body", [
    typed("response.created", "response.in_progress"),  # no end event
    typed(*GOOD_TYPED) + b"data: [DONE]\n\n",
    typed(*GOOD_TYPED, numbers=[0, 2, 3]),
    typed(*GOOD_TYPED, names=["response.created", "response.created"]),
    typed("response.in_progress", "response.completed"),
    typed("response.created", "response.failed", "response.completed"),
    b"",
], ids=["no-end", "done", "sequence", "event-line", "no-created", "two-ends", "empty"])
def test_typed_stream_check_catches_bad_streams(body: bytes) -> None:
    response = fake_response(200, body, "text/event-stream", "/v1/responses")
    with pytest.raises(AssertionError):
        stream_is_terminated(None, response, None)


def test_typed_stream_check_passes_good_streams() -> None:
    for end in END_EVENTS:
        body = typed("response.created", "response.in_progress", end)
        stream_is_terminated(None, fake_response(200, body, "text/event-stream",
                                                 "/v1/responses"), None)


def test_typed_stream_check_splits_lines_as_sse_does() -> None:
    """U+2028 inside an event's JSON is text, not a line break."""
    event = json.dumps({"type": "response.output_text.delta", "sequence_number": 1,
                        "delta": "a\u2028b\x85c"}, ensure_ascii=False)
    body = (typed("response.created").decode() + f"event: response.output_text.delta\n"
            f"data: {event}\n\n" + typed("response.completed").decode().replace(
                '"sequence_number": 0', '"sequence_number": 2'))
    stream_is_terminated(None, fake_response(200, body.encode(), "text/event-stream",
                                             "/v1/responses"), None)
