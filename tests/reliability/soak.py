"""A long soak of mixed traffic against ``specserve serve`` (the default model, or another
with ``--target``), with the server's resident memory and KV blocks sampled throughout.

Workers (24 by default) each loop over a mix a real deployment sees: streamed chats
(sampling defaults, no temperature sent), streams the client drops after two chunks,
bodies that are not JSON, ``n=2`` completions, streamed ``json_schema`` structured
outputs, streamed tool calls, streamed Responses. Every answer is checked: a 5xx, a
non-OpenAI error, a malformed stream or an error line in the server's log is counted as
a failure. Resident memory and the in-process prefix cache's size are sampled every few
seconds; the report gives the curve and the sum the memory should stay within:

    resident <= ready + KV budget (--kv-cache-bytes) + prefix-cache bound + rest

``ready`` is measured (the server's RSS once ready, before traffic: weights, code,
warm-up buffers); the two bounds are the settings the server enforces; ``rest`` is the
allowance for allocator slack and per-request objects (``REST_BYTES``).

    python -m tests.reliability.soak --minutes 30 --json bench-results/soak.json

(``make soak``); ``tests/reliability/test_soak.py`` runs it as a slow test. Many users on
the real model, with requests that set no answer limit and preemptions forced by a small
KV pool:

    python -m tests.reliability.soak --target qwen2.5-coder-1.5b --workers 8 --minutes 10 \
        --kv-cache-bytes 33554432 --json bench-results/soak-qwen.json

The report also gives the preemptions, the KV blocks still held once traffic stops (none
should be), and the resident memory at the end against its value after the first minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.reliability.support import (
    MIB,
    ServeProcess,
    error_problem,
    scrape,
    serve,
)

WORKERS = 24
SAMPLE_S = 5.0
WARM_UP_FRACTION = 0.25  # memory before this share of the run is warm-up
REST_BYTES = 384 * MIB  # allocator slack, per-request objects, tokenizer and grammar caches
KV_CACHE_BYTES = 2048 * MIB  # the server's defaults, passed explicitly to be sure of them
PREFIX_CACHE_BYTES = 512 * MIB
MODEL = "tiny"  # the served name support.serve gives
TOPICS = ["the sea", "a lighthouse", "bread", "winter", "a train", "tea", "bees", "rivers",
          "maps", "clocks", "owls", "glass", "salt", "kites", "moss", "copper"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                            "count": {"type": "integer"}},
          "required": ["name", "count"], "additionalProperties": False}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@dataclass
class Tally:
    requests: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    server_errors: int = 0

    def count(self, kind: str) -> None:
        self.requests[kind] = self.requests.get(kind, 0) + 1

    def fail(self, kind: str, why: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(f"{kind}: {why}")


def _messages(rng: random.Random) -> list[dict[str, str]]:
    topic = rng.choice(TOPICS)
    return [{"role": "user", "content": f"Tell me something about {topic} (#{rng.random():.6f})."}]


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                  drop_after: int | None = None) -> tuple[int, list[str]]:
    """POST a streaming request; the status and its ``data:`` lines (fewer when dropped)."""
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            problem = error_problem(response.status_code, response.content,
                                    response.headers.get("content-type", ""))
            return response.status_code, [problem or ""]
        lines: list[str] = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if drop_after is not None and len(lines) >= drop_after:
                    break  # the connection closes mid-stream
        return 200, lines


def _check_stream(tally: Tally, kind: str, status: int, lines: list[str],
                  done: bool = True) -> None:
    if status >= 500:
        tally.server_errors += 1
    if status != 200:
        tally.fail(kind, f"status {status}: {lines[:1]}")
        return
    if done and (not lines or lines[-1] != "[DONE]"):
        tally.fail(kind, f"stream did not end with [DONE]: {lines[-2:]}")
    for data in lines:
        if data != "[DONE]" and "error" in json.loads(data):
            tally.fail(kind, f"error event {data[:200]}")


async def _one(client: httpx.AsyncClient, kind: str, rng: random.Random, tally: Tally) -> None:
    base = {"model": MODEL, "max_tokens": rng.choice([16, 32, 48])}
    if kind == "chat-stream":
        status, lines = await _stream(client, "/v1/chat/completions",
                                      {**base, "messages": _messages(rng), "stream": True})
        _check_stream(tally, kind, status, lines)
    elif kind == "disconnect":
        status, lines = await _stream(client, "/v1/chat/completions",
                                      {**base, "messages": _messages(rng), "stream": True,
                                       "max_tokens": 200}, drop_after=2)
        _check_stream(tally, kind, status, lines, done=False)
    elif kind == "unbounded":  # no answer limit, as most clients send: read a while, then go
        unbounded = {"model": MODEL, "messages": _messages(rng), "stream": True}
        status, lines = await _stream(client, "/v1/chat/completions", unbounded,
                                      drop_after=rng.choice([8, 32, 96]))
        _check_stream(tally, kind, status, lines, done=bool(lines) and lines[-1] == "[DONE]")
    elif kind == "bad-json":
        response = await client.post("/v1/chat/completions", content=b'{"model": "tiny", "mes',
                                     headers={"content-type": "application/json"})
        if response.status_code != 400 or error_problem(
                400, response.content, response.headers.get("content-type", "")):
            tally.fail(kind, f"{response.status_code} {response.text[:200]}")
    elif kind == "n2":
        response = await client.post("/v1/completions", json={
            **base, "prompt": f"Once upon a time, {rng.choice(TOPICS)}", "n": 2, "seed": 7})
        if response.status_code >= 500:
            tally.server_errors += 1
        if response.status_code != 200 or len(response.json()["choices"]) != 2:
            tally.fail(kind, f"{response.status_code} {response.text[:200]}")
    elif kind == "json-schema":
        status, lines = await _stream(client, "/v1/chat/completions", {
            **base, "max_tokens": 64, "messages": _messages(rng), "stream": True,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "thing", "schema": SCHEMA}}})
        _check_stream(tally, kind, status, lines)
    elif kind == "tools":
        status, lines = await _stream(client, "/v1/chat/completions", {
            **base, "max_tokens": 64, "stream": True, "tools": [TOOL],
            "tool_choice": "required",
            "messages": [{"role": "user", "content": f"Weather in {rng.choice(TOPICS)}?"}]})
        _check_stream(tally, kind, status, lines)
    elif kind == "responses":
        async with client.stream("POST", "/v1/responses", json={
                "model": MODEL, "input": _messages(rng)[0]["content"], "stream": True,
                "max_output_tokens": 32}) as response:
            body = await response.aread()
        if response.status_code >= 500:
            tally.server_errors += 1
        ended = b"event: response.completed" in body or b"event: response.incomplete" in body
        if response.status_code != 200 or not ended:
            tally.fail(kind, f"{response.status_code} {body[-200:]!r}")
    tally.count(kind)


KINDS = ["chat-stream", "chat-stream", "disconnect", "bad-json", "n2", "json-schema", "tools",
         "responses", "unbounded"]


async def _worker(url: str, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0)) as client:
        while time.monotonic() < until:
            kind = rng.choice(KINDS)
            try:
                await _one(client, kind, rng, tally)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                tally.count(kind)
                tally.fail(kind, f"{type(exc).__name__}: {exc}")


def _sample(server: ServeProcess, began: float, stop: threading.Event,
            curve: list[dict[str, float]]) -> None:
    while not stop.wait(SAMPLE_S):
        try:
            metrics = scrape(server.metrics_url)
            curve.append({"t_s": round(time.monotonic() - began, 1),
                          "rss_mib": round(server.rss() / MIB, 1),
                          "prefix_cache_mib": round(
                              metrics.get("specserve_prefix_cache_bytes", 0.0) / MIB, 1),
                          "kv_blocks_used": metrics.get("specserve_kv_blocks_used", 0.0)})
        except Exception:  # the sampler must outlive a slow scrape
            continue


def _idle_blocks(server: ServeProcess, timeout_s: float = 120.0) -> float:
    """The KV blocks held once no request runs (every block should be back)."""
    deadline = time.monotonic() + timeout_s
    metrics = scrape(server.metrics_url)
    while metrics.get("specserve_num_requests_running", 0.0) and time.monotonic() < deadline:
        time.sleep(1.0)
        metrics = scrape(server.metrics_url)
    return metrics.get("specserve_kv_blocks_used", -1.0)


def run(minutes: float, workers: int = WORKERS, target: str = "default",
        kv_cache_bytes: int = KV_CACHE_BYTES) -> dict[str, Any]:
    flags = ("--kv-cache-bytes", str(kv_cache_bytes), "--prefix-cache-bytes",
             str(PREFIX_CACHE_BYTES), "--threads", "2", "--log-level", "warning")
    with serve(Path(target), *flags, start_timeout=900) as server:
        ready = server.rss()
        tally = Tally()
        curve: list[dict[str, float]] = []
        began = time.monotonic()
        stop = threading.Event()
        sampler = threading.Thread(target=_sample, args=(server, began, stop, curve),
                                   daemon=True)
        sampler.start()

        async def drive() -> None:
            until = began + minutes * 60
            await asyncio.gather(*(_worker(server.url, i, until, tally)
                                   for i in range(workers)))

        asyncio.run(drive())
        stop.set()
        sampler.join(timeout=30)
        idle_blocks = _idle_blocks(server)
        preemptions = scrape(server.metrics_url).get("specserve_preemptions_total", 0.0)
        log = server.log_text()
    warm = [p for p in curve if p["t_s"] >= WARM_UP_FRACTION * minutes * 60]
    thirds = [warm[i * len(warm) // 3:(i + 1) * len(warm) // 3] for i in range(3)]
    bound = ready + kv_cache_bytes + PREFIX_CACHE_BYTES + REST_BYTES
    peak = max((p["rss_mib"] for p in curve), default=ready / MIB)
    after_minute = [p["rss_mib"] for p in curve if p["t_s"] >= 60.0]
    return {
        "target": target, "kv_cache_bytes": kv_cache_bytes,
        "preemptions": preemptions, "kv_blocks_idle": idle_blocks,
        "rss_after_first_minute_mib": after_minute[0] if after_minute else None,
        "rss_end_mib": after_minute[-1] if after_minute else None,
        "minutes": minutes, "workers": workers, "requests": sum(tally.requests.values()),
        "by_kind": tally.requests, "server_errors": tally.server_errors,
        "failures": tally.failures,
        "log_errors": [line[:300] for line in log.splitlines()
                       if "Traceback" in line or '"level": "error"' in line][:20],
        "ready_mib": round(ready / MIB, 1), "peak_mib": peak,
        "warm_thirds_max_mib": [max((p["rss_mib"] for p in t), default=0.0) for t in thirds],
        "warm_thirds_median_mib": [statistics.median([p["rss_mib"] for p in t]) if t else 0.0
                                   for t in thirds],
        "bound_mib": {"ready": round(ready / MIB, 1), "kv_budget": kv_cache_bytes / MIB,
                      "prefix_cache": PREFIX_CACHE_BYTES / MIB, "rest": REST_BYTES / MIB,
                      "total": round(bound / MIB, 1)},
        "curve": curve,
    }


def levelled_off(report: dict[str, Any], tolerance_mib: float = 64.0) -> bool:
    """Flat after warm-up: the last third of the run peaks no higher than the middle
    third plus a tolerance (allocator noise), and everything stays within the bound."""
    _, middle, last = report["warm_thirds_max_mib"]
    return last <= middle + tolerance_mib and report["peak_mib"] <= report["bound_mib"]["total"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--json", type=Path, default=Path("bench-results/soak.json"))
    parser.add_argument("--target", default="default", help="a model of the catalogue, or a path")
    parser.add_argument("--kv-cache-bytes", type=int, default=KV_CACHE_BYTES,
                        help="the KV pool; a small one forces preemptions")
    args = parser.parse_args(argv)
    report = run(args.minutes, args.workers, args.target, args.kv_cache_bytes)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"{report['requests']} requests in {args.minutes:g} min, "
          f"{report['server_errors']} 5xx, {len(report['failures'])} failures")
    print("| t (min) | RSS (MiB) | prefix cache (MiB) |\n|---|---|---|")
    step = max(1, len(report["curve"]) // 15)
    for point in report["curve"][::step]:
        print(f"| {point['t_s'] / 60:.1f} | {point['rss_mib']} | {point['prefix_cache_mib']} |")
    print("bound (MiB):", report["bound_mib"], "peak:", report["peak_mib"],
          "warm thirds max:", report["warm_thirds_max_mib"],
          "levelled off:", levelled_off(report))
    print(json.dumps({k: v for k, v in report.items() if k != "curve"}, indent=1)[:3000])
    return 0 if levelled_off(report) and not report["server_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
