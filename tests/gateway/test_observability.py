"""Metrics, spans and request logs produced by real requests."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from decoding.drafter import BaseDrafter, DraftContext, DraftProposal
from decoding.engine import Engine
from decoding.types import RoundEvent
from gateway.server import build_engine, create_app
from observability.metrics import Metrics, start_metrics_server
from observability.telemetry import Telemetry
from observability.tracing import RequestSpan, build_tracer_provider
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import blocks_for
from tests.conftest import free_port, require_program
from tests.gateway.conftest import TINY, in_process, live_server, openai_client, tiny_settings

REPEAT = [{"role": "user", "content": "a b a b a b a b a b"}]  # the tiny model repeats here
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def _telemetry() -> tuple[Telemetry, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = build_tracer_provider(exporter=exporter)
    return Telemetry(TINY, tracer_provider=provider), exporter


def _samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
           **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


async def test_metrics_agree_with_what_the_client_received(tiny_engine: Engine) -> None:
    telemetry, _ = _telemetry()
    app = create_app(tiny_settings(), engine=tiny_engine, telemetry=telemetry)
    async with in_process(app) as client:
        received = 0
        for stream in (False, True):
            body = {"model": TINY, "messages": REPEAT, "max_tokens": 24, "temperature": 0,
                    "stream": stream, "stream_options": {"include_usage": True} if stream
                    else None}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200
            if stream:
                chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                          if line.startswith("data: {")]
                received += chunks[-1]["usage"]["completion_tokens"]
            else:
                received += r.json()["usage"]["completion_tokens"]
        missing = await client.post("/v1/chat/completions",
                                    json={"model": "nope", "messages": REPEAT})
        assert missing.status_code == 404
    s = _samples(telemetry.metrics)
    assert _total(s, "specserve_generation_tokens_total") == received
    drafted = _total(s, "specserve_spec_decode_num_draft_tokens_total")
    accepted = _total(s, "specserve_spec_decode_num_accepted_tokens_total")
    per_pos = _total(s, "specserve_spec_decode_num_accepted_tokens_per_pos_total")
    assert 0 < accepted <= drafted
    assert _total(s, "specserve_spec_decode_num_rejected_tokens_total") == drafted - accepted
    assert per_pos == accepted
    assert _total(s, "specserve_spec_decode_num_drafts_total") > 0
    assert _total(s, "specserve_requests_total", endpoint="/v1/chat/completions",
                  status="200") == 2
    assert _total(s, "specserve_requests_total", endpoint="/v1/chat/completions",
                  status="404") == 1
    assert _total(s, "specserve_request_errors_total", type="not_found") == 1
    assert _total(s, "specserve_time_to_first_token_seconds_count") == 2
    assert _total(s, "specserve_e2e_request_latency_seconds_count") == 2
    assert _total(s, "specserve_round_duration_seconds_count", phase="verify") > 0
    assert _total(s, "specserve_request_success_total", finish_reason="length") == 2
    for name, labels in s:
        assert ":" not in name and name.startswith("specserve_")
        assert "request_id" not in dict(labels)


async def test_concurrent_requests_share_forward_passes(tiny_target: CausalLM) -> None:
    """Rounds of concurrent requests are verified together, and the batch size each
    round ran in is exported. The engine is held until all four wait in its queue, so
    that they start together however busy the machine is."""
    telemetry, _ = _telemetry()
    engine = Engine(tiny_target)
    app = create_app(tiny_settings(), engine=engine, telemetry=telemetry)
    try:
        async with in_process(app) as client:
            body = {"model": TINY, "messages": REPEAT, "max_tokens": 24, "temperature": 0,
                    "speculation": {"enabled": False}}
            posts = [asyncio.create_task(client.post("/v1/chat/completions", json=body))
                     for _ in range(4)]
            deadline = time.monotonic() + 60  # a ceiling only a hang reaches
            while engine.num_waiting < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            engine.start()
            responses = await asyncio.gather(*posts)
    finally:
        engine.shutdown()
    assert all(r.status_code == 200 for r in responses)
    s = _samples(telemetry.metrics)
    rounds = _total(s, "specserve_batch_size_count")
    assert rounds == 4 * 23  # every round after the first token
    # the first rounds ran four at once: each request's first is in the (2, 4] bucket
    in_fours = (_total(s, "specserve_batch_size_bucket", le="4.0")
                - _total(s, "specserve_batch_size_bucket", le="2.0"))
    assert in_fours >= 4, in_fours


async def test_one_span_per_request_and_one_child_per_round(tiny_engine: Engine) -> None:
    telemetry, exporter = _telemetry()
    app = create_app(tiny_settings(), engine=tiny_engine, telemetry=telemetry)
    async with in_process(app) as client:
        r = await client.post("/v1/chat/completions", headers={"traceparent": TRACEPARENT},
                              json={"model": TINY, "messages": REPEAT, "max_tokens": 16,
                                    "temperature": 0, "seed": 3})
        assert r.status_code == 200
        rounds = r.json()["speculation"]["rounds"]
    telemetry.tracer_provider.force_flush()
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.name == f"chat {TINY}"]
    assert len(servers) == 1
    server = servers[0]
    assert f"{server.context.trace_id:032x}" == TRACE_ID, "traceparent honoured"
    attrs = dict(server.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == TINY
    assert attrs["gen_ai.request.max_tokens"] == 16
    assert attrs["gen_ai.request.seed"] == 3
    assert attrs["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    children = [s for s in spans if s.parent is not None
                and s.parent.span_id == server.context.span_id]
    assert len(children) == rounds
    first = dict(children[0].attributes or {})
    for key in ("specserve.round.index", "specserve.round.draft_tokens",
                "specserve.round.accepted_tokens", "specserve.round.draft_ms",
                "specserve.round.verify_ms", "specserve.round.drafter",
                "specserve.round.draft_source"):
        assert key in first
    for span in children:  # a single drafter is its own source; a plain round has none
        a = dict(span.attributes or {})
        source = a["specserve.round.drafter"] if a["specserve.round.draft_tokens"] else "none"
        assert a["specserve.round.draft_source"] == source


def test_without_an_exporter_no_span_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """No endpoint, no exporter: spans would go nowhere, so none is recorded and a
    round starts no child (they cost the event loop time per streamed token); the
    caller's trace id still carries through."""
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    event = RoundEvent(token_ids=(1, 2), text="ab", draft_tokens=2, accepted_tokens=1)
    for exporter in (None, InMemorySpanExporter()):
        provider = build_tracer_provider(exporter=exporter)
        span = RequestSpan(provider.get_tracer("t"), "chat", TINY, {},
                           {"traceparent": TRACEPARENT})
        assert f"{span.span.get_span_context().trace_id:032x}" == TRACE_ID
        assert span.span.is_recording() is (exporter is not None)
        span.round(event, "ngram")
        span.finish("id", ["stop"], 3, 2)
        provider.force_flush()
        if exporter is not None:
            assert [s.name for s in exporter.get_finished_spans()] == [
                "speculation_round", f"chat {TINY}"]
        provider.shutdown()


async def test_one_json_log_line_per_request(tiny_engine: Engine,
                                             caplog: pytest.LogCaptureFixture) -> None:
    telemetry, _ = _telemetry()
    app = create_app(tiny_settings(), engine=tiny_engine, telemetry=telemetry)
    with caplog.at_level(logging.INFO, logger="specserve.requests"):
        async with in_process(app) as client:
            await client.post("/v1/completions", json={"model": TINY, "prompt": "secret words",
                                                       "max_tokens": 4})
    records = [r for r in caplog.records if r.name == "specserve.requests"]
    assert len(records) == 1
    from observability.logging import JsonFormatter

    line = json.loads(JsonFormatter().format(records[0]))
    assert line["status"] == 200 and line["completion_tokens"] == 4
    assert line["request_id"].startswith("cmpl-")
    assert "secret words" not in json.dumps(line)
    assert line["cached_tokens"] == 0  # a prompt never seen before


async def test_the_log_line_counts_the_prompt_tokens_from_the_prefix_cache(
        tiny_target_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    telemetry, _ = _telemetry()
    settings = tiny_settings(target=str(tiny_target_dir), prefix_block_tokens=16)
    engine = build_engine(settings)
    app = create_app(settings, engine=engine, telemetry=telemetry)
    body = {"model": TINY, "prompt": "the same long prompt, word after word " * 8,
            "max_tokens": 2}
    try:
        with caplog.at_level(logging.INFO, logger="specserve.requests"):
            async with in_process(app) as client:
                await client.post("/v1/completions", json=body)
                again = (await client.post("/v1/completions", json=body)).json()
    finally:
        engine.shutdown()
    records = [r for r in caplog.records if r.name == "specserve.requests"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and records[-1].__dict__["cached_tokens"] == cached


def test_metrics_port_serves_a_scrape(tiny_engine: Engine) -> None:
    telemetry, _ = _telemetry()
    server = start_metrics_server(telemetry.metrics, "127.0.0.1", 0)
    try:
        with live_server(create_app(tiny_settings(), engine=tiny_engine,
                                    telemetry=telemetry)) as url:
            openai_client(url).completions.create(model=TINY, prompt="a b a b a b", max_tokens=8)
            text = httpx.get(f"http://127.0.0.1:{server.server_port}/metrics").text
    finally:
        server.shutdown()
    assert re.search(r'^specserve_requests_total\{endpoint="/v1/completions",status="200"\} 1',
                     text, re.M)
    assert "specserve_num_requests_running" in text
    assert "specserve_prefix_cache" not in text  # this engine has no cache


@pytest.fixture()
def prometheus_binary() -> str:
    return require_program("prometheus", "prometheus")


@pytest.fixture()
def prometheus(prometheus_binary: str, tmp_path: Path) -> Iterator[tuple[int, int]]:
    """A real Prometheus scraping a metrics server every second; yields both ports."""
    telemetry_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: specserve\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{telemetry_port}']}}]\n")
    port = free_port()
    process = subprocess.Popen(
        [prometheus_binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'db'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield port, telemetry_port
    finally:
        process.terminate()
        process.wait(timeout=20)


def _query(port: int, expr: str) -> list[dict[str, object]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.request.quote(expr)}"
    with urllib.request.urlopen(url, timeout=5) as response:
        result: list[dict[str, object]] = json.load(response)["data"]["result"]
        return result


def test_real_prometheus_computes_the_acceptance_rate(
    tiny_engine: Engine, prometheus: tuple[int, int]
) -> None:
    prom_port, metrics_port = prometheus
    telemetry, _ = _telemetry()
    server = start_metrics_server(telemetry.metrics, "127.0.0.1", metrics_port)
    try:
        with live_server(create_app(tiny_settings(), engine=tiny_engine,
                                    telemetry=telemetry)) as url:
            client = openai_client(url)
            deadline = time.monotonic() + 60
            expr = ("sum(specserve_spec_decode_num_accepted_tokens_total) / "
                    "sum(specserve_spec_decode_num_draft_tokens_total)")
            result: list[dict[str, object]] = []
            while time.monotonic() < deadline and not result:
                client.chat.completions.create(model=TINY, messages=REPEAT,  # type: ignore[arg-type]
                                               max_tokens=24, temperature=0)
                time.sleep(1.0)
                try:
                    result = _query(prom_port, expr)
                except OSError:
                    continue
            assert result, "Prometheus never scraped the metrics port"
            # no more requests: wait for a scrape of the final counters, then compare
            s = _samples(telemetry.metrics)
            drafted = _total(s, "specserve_spec_decode_num_draft_tokens_total")
            expected = _total(s, "specserve_spec_decode_num_accepted_tokens_total") / drafted
            scraped = 0.0
            while time.monotonic() < deadline + 30 and scraped != drafted:
                time.sleep(0.5)
                totals = _query(prom_port, "sum(specserve_spec_decode_num_draft_tokens_total)")
                scraped = float(totals[0]["value"][1]) if totals else 0.0  # type: ignore[index]
            assert scraped == drafted, "Prometheus never scraped the final counters"
            value = float(_query(prom_port, expr)[0]["value"][1])  # type: ignore[index]
            assert 0 < value <= 1
            assert value == pytest.approx(expected, rel=1e-9)
    finally:
        server.shutdown()


async def test_constrained_requests_and_grammar_drafts_are_counted(tiny_engine: Engine) -> None:
    telemetry, _ = _telemetry()
    app = create_app(tiny_settings(), engine=tiny_engine, telemetry=telemetry)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    async with in_process(app) as client:
        r = await client.post("/v1/chat/completions", json={
            "model": TINY, "messages": REPEAT, "max_tokens": 20, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "a", "schema": schema}}})
        assert r.status_code == 200 and json.loads(r.json()["choices"][0]["message"]["content"])
    s = _samples(telemetry.metrics)
    assert _total(s, "specserve_constrained_requests_total", kind="json_schema") == 1
    forced = _total(s, "specserve_grammar_forced_draft_tokens_total")
    assert 0 < _total(s, "specserve_grammar_forced_accepted_tokens_total") <= forced
    assert _total(s, "specserve_grammar_mask_seconds_count") > 0


FUNCTION = {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}
RESPONSES_TOOLS = {"tools": [{"type": "function", **FUNCTION}], "tool_choice": "required",
                   "parallel_tool_calls": False}


async def test_responses_get_request_metrics_spans_and_tool_counts(tiny_engine: Engine) -> None:
    """A /v1/responses request is measured like a chat completion: request counters,
    latency, tokens, a server span with a child per round; tool calls are counted."""
    telemetry, exporter = _telemetry()
    app = create_app(tiny_settings(), engine=tiny_engine, telemetry=telemetry)
    base = {"model": TINY, "input": REPEAT[0]["content"], "max_output_tokens": 30,
            "temperature": 0}
    async with in_process(app) as client:
        whole = await client.post("/v1/responses", json=base)
        streamed = await client.post("/v1/responses", json={**base, "stream": True})
        called = await client.post("/v1/responses", json={**base, **RESPONSES_TOOLS})
    assert whole.status_code == streamed.status_code == called.status_code == 200
    last = json.loads([line for line in streamed.text.splitlines()
                       if line.startswith("data: ")][-1][6:])["response"]
    bodies = [whole.json(), last, called.json()]
    calls = [item for item in called.json()["output"] if item["type"] == "function_call"]
    assert len(calls) == 1
    s = _samples(telemetry.metrics)
    assert _total(s, "specserve_requests_total", endpoint="/v1/responses", status="200") == 3
    assert _total(s, "specserve_e2e_request_latency_seconds_count",
                  endpoint="/v1/responses") == 3
    assert _total(s, "specserve_time_to_first_token_seconds_count",
                  endpoint="/v1/responses") == 3
    assert _total(s, "specserve_generation_tokens_total") == sum(
        b["usage"]["output_tokens"] for b in bodies)
    assert _total(s, "specserve_tool_calls_total", endpoint="/v1/responses",
                  tool_choice="required") == 1
    assert _total(s, "specserve_constrained_requests_total", kind="tools") == 1
    telemetry.tracer_provider.force_flush()
    spans = exporter.get_finished_spans()
    servers = [x for x in spans if x.name == f"chat {TINY}"]
    assert len(servers) == 3
    for server, body in zip(servers, bodies, strict=True):
        assert dict(server.attributes or {})["gen_ai.response.id"] == body["id"]
        children = [x for x in spans if x.parent is not None
                    and x.parent.span_id == server.context.span_id]
        assert len(children) == body["speculation"]["rounds"] >= 1
    assert dict(servers[2].attributes or {})["specserve.tool_calls"] == 1


async def test_chat_tool_calls_are_counted_by_choice_mode(tiny_engine: Engine) -> None:
    telemetry, _ = _telemetry()
    app = create_app(tiny_settings(), engine=tiny_engine, telemetry=telemetry)
    tools = [{"type": "function", "function": FUNCTION}]
    base = {"model": TINY, "messages": REPEAT, "max_tokens": 30, "temperature": 0,
            "tools": tools, "parallel_tool_calls": False}
    named = {"type": "function", "function": {"name": "f"}}
    async with in_process(app) as client:
        forced = await client.post("/v1/chat/completions", json={**base, "tool_choice": named})
        streamed = await client.post("/v1/chat/completions",
                                     json={**base, "tool_choice": "required", "stream": True})
        plain = await client.post("/v1/chat/completions", json={**base, "tool_choice": "none"})
    assert forced.status_code == streamed.status_code == plain.status_code == 200
    assert len(forced.json()["choices"][0]["message"]["tool_calls"]) == 1
    assert '"tool_calls":[{"index":0,"id":"call_' in streamed.text
    s = _samples(telemetry.metrics)
    chat = "/v1/chat/completions"
    assert _total(s, "specserve_tool_calls_total", endpoint=chat, tool_choice="named") == 1
    assert _total(s, "specserve_tool_calls_total", endpoint=chat, tool_choice="required") == 1
    assert _total(s, "specserve_tool_calls_total") == 2  # tool_choice none offers no tools
    assert _total(s, "specserve_constrained_requests_total", kind="tools") == 2


def test_real_prometheus_scrapes_responses_and_tool_calls(
    tiny_engine: Engine, prometheus: tuple[int, int]
) -> None:
    """Prometheus sees /v1/responses under its own endpoint label and the tool calls."""
    prom_port, metrics_port = prometheus
    telemetry, _ = _telemetry()
    server = start_metrics_server(telemetry.metrics, "127.0.0.1", metrics_port)
    expr = 'sum(specserve_tool_calls_total{endpoint="/v1/responses",tool_choice="required"})'
    try:
        with live_server(create_app(tiny_settings(), engine=tiny_engine,
                                    telemetry=telemetry)) as url:
            client = openai_client(url)
            reply = client.responses.create(model=TINY, input="Call f.", max_output_tokens=30,
                                            temperature=0, **RESPONSES_TOOLS)  # type: ignore[arg-type]
            assert [item.type for item in reply.output] == ["function_call"]
            deadline = time.monotonic() + 60
            scraped: list[dict[str, object]] = []
            while time.monotonic() < deadline and not scraped:
                time.sleep(0.5)
                try:
                    scraped = _query(prom_port, expr)
                except OSError:
                    continue
            assert scraped, "Prometheus never scraped the tool-call counter"
            assert float(scraped[0]["value"][1]) == 1  # type: ignore[index]
            requests = _query(prom_port, 'sum(specserve_requests_total'
                                         '{endpoint="/v1/responses",status="200"})')
            assert float(requests[0]["value"][1]) == 1  # type: ignore[index]
    finally:
        server.shutdown()


class GatedDrafter(BaseDrafter):
    """Holds its first proposal until released, so a request stays running."""

    name = "gate"

    def __init__(self) -> None:
        self.entered, self.release_all = threading.Event(), threading.Event()

    def begin(self, prompt_ids: Sequence[int]) -> None:
        return None

    def propose(self, state: Any, context: DraftContext, k: int) -> DraftProposal:
        self.entered.set()
        self.release_all.wait(60)
        return DraftProposal.empty()

    def rollback(self, state: Any, length: int) -> None:
        return None

    def release(self, state: Any) -> None:
        return None


async def test_the_engine_bounds_and_its_kv_blocks_are_exported(tiny_target: CausalLM
                                                                 ) -> None:
    """Queue and KV use can be read as shares of their bounds: the bounds are exported,
    and the KV gauges read the blocks the running requests hold, as the pool counts them:
    a running request's prompt and its first token, not its longest answer."""
    drafter = GatedDrafter()
    engine = Engine(tiny_target, {"gate": drafter}, default_drafter="gate", max_queue=5,
                    max_active=3, max_kv_bytes=64 << 20)
    engine.start()
    telemetry, _ = _telemetry()
    block_bytes = tiny_target.kv_block_bytes
    pool = (64 << 20) // block_bytes
    try:
        async with in_process(create_app(tiny_settings(), engine=engine,
                                         telemetry=telemetry)) as client:
            idle = _samples(telemetry.metrics)
            assert _total(idle, "specserve_max_requests_waiting") == 5
            assert _total(idle, "specserve_max_requests_running") == 3
            assert _total(idle, "specserve_kv_cache_limit_bytes") == 64 << 20
            assert _total(idle, "specserve_kv_cache_used_bytes") == 0
            assert _total(idle, "specserve_kv_blocks_free") == pool
            assert _total(idle, "specserve_preemptions_total") == 0
            prompt = [1, 2, 3, 4, 5] * 5  # 25 tokens: two blocks
            reply = asyncio.create_task(client.post("/v1/completions", json={
                "model": TINY, "prompt": prompt, "max_tokens": 200, "temperature": 0}))
            assert await asyncio.to_thread(drafter.entered.wait, 30), "no round drafted"
            busy = _samples(telemetry.metrics)
            drafter.release_all.set()
            assert (await reply).status_code == 200
        assert _total(busy, "specserve_kv_blocks_used") == blocks_for(len(prompt)) == 2
        assert _total(busy, "specserve_kv_cache_used_bytes") == 2 * block_bytes
        assert _total(busy, "specserve_kv_blocks_free") == pool - 2
        assert _total(busy, "specserve_kv_blocks_shared") == 0
        assert _total(busy, "specserve_num_requests_running") == 1
        assert _total(_samples(telemetry.metrics), "specserve_kv_blocks_used") == 0
    finally:
        drafter.release_all.set()
        engine.shutdown()


def test_an_unbounded_kv_exports_no_limit() -> None:
    metrics = Metrics()
    metrics.track_capacity(8, 2, None, lambda: {"used": 3, "shared": 1, "block_bytes": 10,
                                                "preemptions": 2})
    samples = _samples(metrics)
    names = {name for name, _ in samples}
    assert "specserve_kv_cache_limit_bytes" not in names
    assert "specserve_kv_blocks_free" not in names
    assert _total(samples, "specserve_kv_cache_used_bytes") == 30
    assert _total(samples, "specserve_kv_blocks_shared") == 1
    assert _total(samples, "specserve_preemptions_total") == 2


def test_the_invariance_check_and_the_cache_are_read_at_scrape_time() -> None:
    """The exporter reads the core's counters each scrape, from plain counts."""
    from decoding.invariance import InvarianceStats
    from decoding.prefix_cache import CacheStats

    metrics, invariance, cache = Metrics(), InvarianceStats(), CacheStats()
    metrics.track_invariance(invariance.counts)
    metrics.track_cache(cache.counts, "in-process")

    def scraped() -> dict[str, float]:
        return {s.name: s.value
                for family in text_string_to_metric_families(
                    generate_latest(metrics.registry).decode())
                for s in family.samples if s.name.endswith("_total")}

    assert scraped()["specserve_invariance_mismatches_total"] == 0
    invariance.checks, invariance.mismatches = 5, 1
    cache.add(lookups=3, hits=2, errors=1)
    now = scraped()
    assert now["specserve_invariance_checks_total"] == 5
    assert now["specserve_invariance_mismatches_total"] == 1
    assert now["specserve_prefix_cache_lookups_total"] == 3
    assert now["specserve_prefix_cache_hits_total"] == 2
    assert now["specserve_cache_errors_total"] == 1


def test_the_in_process_cache_size_is_a_gauge_read_at_scrape_time() -> None:
    from decoding.prefix_cache import InProcessStore

    metrics, store = Metrics(), InProcessStore(max_bytes=1000)
    metrics.track_cache_bytes(lambda: store.size_bytes)

    def size() -> float:
        text = generate_latest(metrics.registry).decode()
        (sample,) = [s for family in text_string_to_metric_families(text)
                     for s in family.samples if s.name == "specserve_prefix_cache_bytes"]
        return float(sample.value)

    assert size() == 0
    store.put_many([(b"k" * 10, b"v" * 90)])
    assert size() == 100
    store.put_many([(b"j" * 10, b"w" * 990)])  # over the bound: the oldest goes
    assert size() == 1000


def test_the_position_labels_cover_the_longest_draft() -> None:
    from decoding.policy import MAX_DRAFT_TOKENS
    from observability.metrics import POSITION_LABELS

    assert POSITION_LABELS >= MAX_DRAFT_TOKENS
