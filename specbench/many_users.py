"""``python -m specbench.many_users``: many users on one model. For each number of
concurrent streams N, llama.cpp's ``llama-server`` and specserve (without a drafter, and with
its default one) each serve N streamed chat requests that set no ``max_tokens``, as clients
that send no limit do; and, with seven streams decoding, one more request at a time, whose
time to first token says how long a new user waits on a busy server.

    python -m specbench.many_users --llama-server ~/llama.cpp/build/bin/llama-server \\
        --target qwen2.5-coder-1.5b --streams 1,2,4,8,16 --json bench-results/many-users.json

The servers, each with ``--threads`` threads (llama-server ``-t N -tb N``), run one at a
time: each is started, measured and stopped before the next starts, so that none competes
with another for the cores, and each starts afresh for every N (no cache carries over):

- ``llama-server``: ``-np N --kv-unified -c N*8192``, N slots over one KV cache;
- ``specserve-none``: ``--draft none``; ``specserve``: ``--draft auto``, its default
  drafter; both with ``--max-active 16`` and the default KV budget (``--kv-cache-bytes``).

Requests are greedy (``temperature: 0``; llama-server also gets ``repeat_penalty: 1.0``,
else it penalises repeats) and use held-out prompts (``--prompt-sets``, by default the
shipped ``code_chat`` and ``chat`` sets, 22 prompts never used to tune a drafter), a prompt
of its own for each stream. Each server first answers one short warm-up request on a
message of no prompt set. An answer without a limit can run to the end of the context, so
the client closes each stream once it has received ``--max-new`` tokens; the request never
says so.

Tokens are counted by the same rule for every server: the server's own running count of the
tokens it has sent, which each chunk carries: llama-server's ``timings.predicted_n`` (sent
on every chunk when the request asks for ``timings_per_token``), specserve's ``speculation``
totals (``rounds + accepted_tokens``: each round commits its accepted drafts and one token
of the target's own), and the ``usage`` of a stream that ends by itself. Counting content
chunks instead would undercount specserve, which sends a round's tokens in one chunk; a
server that sent no count would be counted one token a content chunk (the JSON says which
count each server's streams used).

Per server and N:

- aggregate tokens/s: all streams' tokens over the time from the first request sent to the
  last stream closed;
- per-stream tokens/s (median over the streams): a stream's tokens after its first chunk
  over the time from its first chunk to its last;
- time to first token, p50 and p95 over the N streams;
- the server process's resident memory at the end of the round (``VmRSS`` in
  ``/proc/PID/status``, and its peak, ``VmHWM``);
- for specserve, the KV its running requests hold, the most seen while the streams run
  (``specserve_kv_blocks_used``, ``specserve_kv_cache_used_bytes`` on its metrics port,
  read every half second: a scrape costs the server a little CPU, so not more often);
  for llama-server, the KV cache it reserves at start-up for its whole context (f16 keys
  and values, by the GGUF file's attention shape).

The second measurement, time to first token while ``--busy`` (7) streams decode, runs in
the round of N = busy + 1 (added to the rounds if ``--streams`` lacks it): the busy streams
start, and once every one has produced a token a new request, on a prompt no earlier request
of the round sent (so none of it is cached), is timed to its first token, then closed;
``--probes`` times over (a busy stream whose answer ends is sent again, and the next probe
waits until it decodes). Between measurements the client waits until the
server is idle (no slot processing, no request running), so that decoding left over from a
closed stream never overlaps the next measurement; how long that took is in the JSON.

The table gives every row and, per N, the aggregate tokens/s side by side with the ratios
specserve-none / llama-server, specserve / llama-server and specserve / specserve-none. The
JSON holds the rows, the ratios, the machine (``lscpu``, notable CPU flags, memory read
bandwidth measured before and after), each server's command line per round, and the servers
that failed, with the end of their logs; ``NAME.png`` beside it plots aggregate tokens/s
against N per server. Every server this command starts is stopped when it ends, however it
ends.

Run it on a quiet machine: with other processes on the cores, llama-server's threads, which
wait for each other at every step, lose far more than their share (the command warns where
the load average says the machine is busy).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx

from specbench.compare import Prompt, json_output, load_prompts
from specbench.peer import GREEDY_EXTRAS, WARMUP_MESSAGES, quantile
from specbench.peer_run import (
    START_TIMEOUT_S,
    Server,
    add_peer_arguments,
    close_machine_record,
    exit_on_signal,
    gguf_file,
    locate,
    log_tail,
    machine_record,
    running,
    versions,
)

log = logging.getLogger(__name__)

SERVERS = ("llama-server", "specserve-none", "specserve")
REFERENCE = "llama-server"
DEFAULT_STREAMS = "1,2,4,8,16"
DEFAULT_SETS = "code_chat,chat"
DEFAULT_JSON = "bench-results/many-users.json"
MAX_NEW = 128
CONTEXT_PER_STREAM = 8192
MAX_ACTIVE = 16
BUSY = 7
PROBES = 5
THREADS = 2
BASE_PORT = 18200  # each server start takes the next two ports (API, metrics)
WARMUP_TOKENS = 8
TIMEOUT_S = 600.0
IDLE_TIMEOUT_S = 120.0
POLL_S = 0.25  # while waiting for a server to be idle
KV_POLL_S = 0.5  # a scrape costs specserve a little CPU: not more often than this
MIB = 1 << 20
MS = 1000.0
KV_GAUGES = ("specserve_kv_blocks_used", "specserve_kv_cache_used_bytes")
BUSY_GAUGES = ("specserve_num_requests_running", "specserve_num_requests_waiting")
BUSY_LOAD = 0.5  # per CPU: a load average above it before the start draws a warning
FLAGS_OF_NOTE = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                 "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


class BenchError(Exception):
    """A server that answered with an error, or never became busy or idle as asked."""


@dataclass(frozen=True)
class Round:
    """One N: whether its throughput is measured, and whether the busy-TTFT probes run."""

    n: int
    throughput: bool
    probe: bool


@dataclass
class Target:
    """A started server as the client sees it."""

    name: str
    url: str
    metrics_url: str | None  # specserve's Prometheus endpoint
    extras: dict[str, Any]
    model: str = ""


@dataclass
class Stream:
    """One streamed answer: its times (``perf_counter``) and the tokens it brought."""

    sent: float
    first: float | None = None  # the first chunk with text
    last: float | None = None  # the last chunk with text
    closed: float = 0.0
    tokens: int = 0
    at_first: int = 0  # tokens counted when the first text came
    counted_by: str = "chunks"
    finish: str | None = None  # None: closed by the client

    @property
    def ttft_s(self) -> float:
        return (self.first if self.first is not None else self.closed) - self.sent

    @property
    def tokens_per_s(self) -> float | None:
        """The stream's decoding rate: tokens after its first chunk over the time since."""
        if self.first is None or self.last is None or self.last <= self.first:
            return None
        return (self.tokens - self.at_first) / (self.last - self.first)


# -- one stream -----------------------------------------------------------------------------


def server_count(chunk: dict[str, Any]) -> tuple[int | None, str]:
    """The server's own count of the tokens sent so far, where the chunk carries one."""
    usage = chunk.get("usage") or {}
    if usage.get("completion_tokens") is not None:
        return int(usage["completion_tokens"]), "usage"
    timings = chunk.get("timings") or {}
    if timings.get("predicted_n") is not None:
        return int(timings["predicted_n"]), "timings.predicted_n"
    speculation = chunk.get("speculation") or {}
    if speculation.get("round") is not None:
        return int(speculation["rounds"]) + int(speculation["accepted_tokens"]), "speculation"
    return None, "chunks"


def take(stream: Stream, chunk: dict[str, Any], now: float) -> None:
    """Account for one chunk of ``stream``."""
    choices = chunk.get("choices") or ()
    text = "".join((c.get("delta") or {}).get("content") or "" for c in choices)
    stream.finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")),
                         stream.finish)
    count, counted_by = server_count(chunk)
    if count is not None:
        stream.tokens = max(stream.tokens, count)
        stream.counted_by = counted_by if counted_by != "usage" else stream.counted_by
    elif text and stream.counted_by == "chunks":
        stream.tokens += 1
    if text:
        stream.last = now
        if stream.first is None:
            stream.first, stream.at_first = now, stream.tokens


async def stream_chat(client: httpx.AsyncClient, target: Target, prompt: Prompt,
                      limit: int | None, on_first: Callable[[], None] | None = None) -> Stream:
    """One greedy streamed chat completion without ``max_tokens``, closed by the client once
    ``limit`` tokens have come (None: read to its end); ``on_first`` is called at its first
    text."""
    payload = {"model": target.model, "messages": list(prompt.messages), "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}, **target.extras}
    stream = Stream(sent=time.perf_counter())
    async with client.stream("POST", f"{target.url}/v1/chat/completions",
                             json=payload) as response:
        if response.status_code != 200:
            await response.aread()
            raise BenchError(f"{target.name} answered {response.status_code}: "
                             f"{response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise BenchError(f"{target.name} failed mid-stream: {chunk['error']}")
            take(stream, chunk, time.perf_counter())
            if on_first is not None and stream.first is not None:
                on_first()
                on_first = None
            if limit is not None and stream.tokens >= limit:
                break  # leaving the block closes the connection: the server stops
    stream.closed = time.perf_counter()
    return stream


# -- the server's state ---------------------------------------------------------------------


def gauges(text: str) -> dict[str, float]:
    """Prometheus exposition text: each sample's value, summed over labels, by name."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name] = found.get(sample.name, 0.0) + float(sample.value)
    return found


async def is_idle(client: httpx.AsyncClient, target: Target) -> bool:
    """Whether the server decodes nothing: no llama-server slot processing, no specserve
    request running or waiting."""
    if target.metrics_url is None:
        slots = (await client.get(f"{target.url}/slots")).json()
        return not any(slot.get("is_processing") for slot in slots)
    found = gauges((await client.get(target.metrics_url)).text)
    return sum(found.get(name, 0.0) for name in BUSY_GAUGES) == 0


async def wait_idle(client: httpx.AsyncClient, target: Target) -> float:
    """Seconds until the server is idle (at most ``IDLE_TIMEOUT_S``, then it is an error)."""
    began = time.perf_counter()
    while not await is_idle(client, target):
        if time.perf_counter() - began > IDLE_TIMEOUT_S:
            raise BenchError(f"{target.name} still busy {IDLE_TIMEOUT_S:.0f} s after its "
                             "streams were closed")
        await asyncio.sleep(POLL_S)
    return round(time.perf_counter() - began, 3)


async def sample_kv(client: httpx.AsyncClient, url: str, peak: dict[str, float]) -> None:
    """Keep the most of each KV gauge in ``peak``, and the number of reads, until
    cancelled."""
    while True:
        with contextlib.suppress(httpx.HTTPError):
            found = gauges((await client.get(url)).text)
            peak["samples"] = peak.get("samples", 0.0) + 1
            for name in KV_GAUGES:
                if name in found:
                    peak[name] = max(peak.get(name, 0.0), found[name])
        await asyncio.sleep(KV_POLL_S)


# -- the measurements -----------------------------------------------------------------------


async def throughput(client: httpx.AsyncClient, target: Target, prompts: Sequence[Prompt],
                     n: int, max_new: int) -> dict[str, Any]:
    """N streams at once, each on a prompt of its own, each closed at ``max_new`` tokens."""
    peak: dict[str, float] = {}
    sampler = (asyncio.create_task(sample_kv(client, target.metrics_url, peak))
               if target.metrics_url else None)
    began = time.perf_counter()
    try:
        streams = await asyncio.gather(*(stream_chat(client, target, prompts[i % len(prompts)],
                                                     max_new) for i in range(n)))
    finally:
        if sampler is not None:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
    return summarise(streams, max(s.closed for s in streams) - began, peak)


def summarise(streams: Sequence[Stream], wall: float, peak: dict[str, float]
              ) -> dict[str, Any]:
    tokens = sum(s.tokens for s in streams)
    rates = [r for s in streams if (r := s.tokens_per_s) is not None]
    ttft = [s.ttft_s for s in streams]
    kv_bytes = peak.get("specserve_kv_cache_used_bytes")
    return {
        "streams": len(streams), "tokens": tokens, "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "stream_tokens_per_s_median": round(statistics.median(rates), 2) if rates else None,
        "ttft_ms_p50": round(statistics.median(ttft) * MS, 1),
        "ttft_ms_p95": round(quantile(ttft, 0.95) * MS, 1),
        "ended_by_server": sum(s.finish is not None for s in streams),
        "counted_by": sorted({s.counted_by for s in streams}),
        "kv_blocks_used_max": peak.get("specserve_kv_blocks_used"),
        "kv_used_mib_max": round(kv_bytes / MIB, 1) if kv_bytes is not None else None,
        "kv_samples": int(peak.get("samples", 0)),  # a short round may be read only before
        "per_stream": [{**asdict(s), "ttft_s": round(s.ttft_s, 4)} for s in streams],
    }


async def keep_decoding(client: httpx.AsyncClient, target: Target, prompt: Prompt,
                        decoding: asyncio.Event) -> None:
    """One busy stream until cancelled: ``decoding`` is set while its answer has begun; an
    answer that ends is asked for again."""
    while True:
        decoding.clear()
        await stream_chat(client, target, prompt, None, on_first=decoding.set)


async def all_decoding(events: Sequence[asyncio.Event], workers: Sequence[asyncio.Task[None]],
                       name: str) -> None:
    """Wait until every busy stream decodes; a busy stream that failed ends the wait."""
    ready: asyncio.Future[Any] = asyncio.ensure_future(
        asyncio.gather(*(e.wait() for e in events)))
    waited: list[asyncio.Future[Any]] = [ready, *workers]
    done, _ = await asyncio.wait(waited, timeout=TIMEOUT_S,
                                 return_when=asyncio.FIRST_COMPLETED)
    if ready not in done:
        ready.cancel()
        raise BenchError(f"{name}: the busy streams did not all decode within "
                         f"{TIMEOUT_S:.0f} s (or one failed)")


async def busy_ttft(client: httpx.AsyncClient, target: Target, prompts: Sequence[Prompt],
                    busy: int, probes: int) -> dict[str, Any]:
    """Time to first token of one new request at a time while ``busy`` streams decode."""
    events = [asyncio.Event() for _ in range(busy)]
    workers = [asyncio.create_task(keep_decoding(client, target, prompts[i % len(prompts)], e))
               for i, e in enumerate(events)]
    ttft: list[float] = []
    try:
        for j in range(probes):
            await all_decoding(events, workers, target.name)
            # from the list's end: a prompt no earlier request of the round has sent
            probe = await stream_chat(client, target, prompts[-1 - j % len(prompts)], 1)
            ttft.append(probe.ttft_s)
    finally:
        for worker in workers:
            worker.cancel()
        failed = [r for r in await asyncio.gather(*workers, return_exceptions=True)
                  if not isinstance(r, asyncio.CancelledError)]
    if failed:
        raise BenchError(f"{target.name}: a busy stream failed: {failed[0]!r}")
    return {"busy_streams": busy, "probes": probes,
            "ttft_ms": [round(t * MS, 1) for t in ttft],
            "ttft_ms_p50": round(statistics.median(ttft) * MS, 1),
            "ttft_ms_p95": round(quantile(ttft, 0.95) * MS, 1)}


async def connect(client: httpx.AsyncClient, target: Target) -> None:
    """Find the served model's id and warm the server up."""
    models = (await client.get(f"{target.url}/v1/models")).json().get("data") or []
    if not models:
        raise BenchError(f"{target.name} serves no model")
    target.model = str(models[0]["id"])
    await stream_chat(client, target, Prompt("warm-up", WARMUP_MESSAGES), WARMUP_TOKENS)


async def measure(target: Target, job: Round, prompts: Sequence[Prompt],
                  args: argparse.Namespace) -> dict[str, Any]:
    """A round's measurements on one started server."""
    limits = httpx.Limits(max_connections=job.n + args.busy + 4)
    result: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits) as client:
        await connect(client, target)
        await wait_idle(client, target)
        if job.throughput:
            result["throughput"] = await throughput(client, target, prompts, job.n,
                                                    args.max_new)
            result["idle_after_s"] = await wait_idle(client, target)
            log.info("%s N=%d: %.1f tokens/s", target.name, job.n,
                     result["throughput"]["tokens_per_s"] or 0.0)
        if job.probe:
            result["busy_ttft"] = await busy_ttft(client, target, prompts, args.busy,
                                                  args.probes)
            await wait_idle(client, target)
    return result


# -- the servers ----------------------------------------------------------------------------


def plan_server(args: argparse.Namespace, name: str, n: int, gguf: Path | None,
                port: int) -> Server:
    """The command line of one server for a round of N streams, on ``port`` (and, for
    specserve, its metrics on the next port)."""
    threads = str(args.threads)
    if name == REFERENCE:
        assert gguf is not None
        argv = [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "-t", threads,
                "-tb", threads, "-np", str(n), "--kv-unified", "-c", str(n * args.context),
                "--port", str(port)]
        return Server(name, argv, port, "/health", (gguf,))
    draft = "none" if name == "specserve-none" else "auto"
    argv = [sys.executable, "-m", "specserve.cli", "serve", "--host", "127.0.0.1",
            "--target", args.target, "--threads", threads, "--log-format", "text",
            "--draft", draft, "--max-active", str(args.max_active), "--port", str(port),
            "--metrics-port", str(port + 1)]
    return Server(name, argv, port, "/ready", ())


def target_of(server: Server) -> Target:
    """How the client talks to a started server: llama-server is asked for greedy sampling
    without its repeat penalty and for its token count on every chunk."""
    if server.kind == "llama-server":
        extras = {**GREEDY_EXTRAS, "timings_per_token": True}
        return Target(server.name, server.url, None, extras)
    return Target(server.name, server.url, f"http://127.0.0.1:{server.port + 1}/metrics", {})


def memory_of(pid: int) -> dict[str, float | None]:
    """A process's resident memory now and at its peak, in MiB (``/proc/PID/status``)."""
    found: dict[str, float | None] = {"rss_mib": None, "peak_rss_mib": None}
    keys = {"VmRSS:": "rss_mib", "VmHWM:": "peak_rss_mib"}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status", encoding="utf-8") as status:
        for line in status:
            key, *rest = line.split()
            if key in keys and rest:
                found[keys[key]] = round(int(rest[0]) * 1024 / MIB, 1)
    return found


def llama_kv_mib(model: Path, context: int) -> float | None:
    """The KV cache llama-server allocates for ``context`` tokens: f16 keys and values (its
    default) in every layer, by the GGUF file's attention shape; None where it lacks one."""
    try:
        import gguf

        fields = gguf.GGUFReader(model).fields
        arch = f"{fields['general.architecture'].contents()}."
        heads = _gguf_int(fields, arch + "attention.head_count")
        head_dim = _gguf_int(fields, arch + "embedding_length") // heads
        width = (_gguf_int(fields, arch + "attention.key_length", head_dim)
                 + _gguf_int(fields, arch + "attention.value_length", head_dim))
        kv_heads = _gguf_int(fields, arch + "attention.head_count_kv", heads)
        layers = _gguf_int(fields, arch + "block_count")
    except (ImportError, KeyError, TypeError, ValueError, OSError):
        return None
    return round(context * layers * kv_heads * width * 2 / MIB, 1)


def _gguf_int(fields: dict[str, Any], key: str, default: int | None = None) -> int:
    """A GGUF file's integer field; ``default`` where it is missing (a KeyError without)."""
    if key in fields:
        return int(fields[key].contents())
    if default is None:
        raise KeyError(key)
    return default


def run_one(server: Server, job: Round, prompts: Sequence[Prompt], args: argparse.Namespace,
            logs: Path) -> dict[str, Any]:
    """Start one server, measure it, read its memory, stop it: its row of the round."""
    logs.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"server": server.name, "n": job.n}
    with running([server], logs, args.start_timeout) as up:
        if up and server.process is not None:
            try:
                record.update(asyncio.run(measure(target_of(server), job, prompts, args)))
            except (BenchError, httpx.HTTPError, TimeoutError) as exc:
                record["failure"] = f"{type(exc).__name__}: {exc}"
                log.error("%s N=%d failed: %s", server.name, job.n, record["failure"])
            record["memory"] = memory_of(server.process.pid)
    if server.kind == "llama-server" and server.models:
        record["kv_reserved_mib"] = llama_kv_mib(server.models[0], job.n * args.context)
    if server.failure:
        record["failure"] = server.failure
        record["log_tail"] = log_tail(server.log_path)
    record["launch"] = server.record()
    return record


def plan_rounds(streams: Sequence[int], busy: int, probes: int) -> list[Round]:
    probe_n = busy + 1 if probes > 0 else None
    levels = sorted({*streams, *([probe_n] if probe_n else [])})
    return [Round(n, n in streams, n == probe_n) for n in levels]


def run_rounds(args: argparse.Namespace, servers: Sequence[str], gguf: Path | None,
               prompts: Sequence[Prompt], logs: Path) -> list[dict[str, Any]]:
    """Every round, every server in it one after another."""
    records = []
    port = args.base_port
    for job in plan_rounds(args.streams, args.busy, args.probes):
        for name in servers:
            server = plan_server(args, name, job.n, gguf, port)
            port += 2
            records.append(run_one(server, job, prompts, args, logs / f"n{job.n}"))
    return records


# -- the report -----------------------------------------------------------------------------


RATIOS = (("specserve-none/llama-server", "specserve-none", REFERENCE),
          ("specserve/llama-server", "specserve", REFERENCE),
          ("specserve/specserve-none", "specserve", "specserve-none"))


def ratios(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per N, each server's aggregate tokens/s and the three ratios."""
    rates: dict[int, dict[str, float]] = {}
    for r in records:
        rate = (r.get("throughput") or {}).get("tokens_per_s")
        if rate:
            rates.setdefault(r["n"], {})[r["server"]] = rate
    rows = []
    for n, by in sorted(rates.items()):
        rows.append({"n": n, **{f"{s}_tokens_per_s": by.get(s) for s in SERVERS},
                     **{key: _ratio(by, over, under) for key, over, under in RATIOS}})
    return rows


def _ratio(rates: dict[str, float], over: str, under: str) -> float | None:
    return round(rates[over] / rates[under], 3) if over in rates and under in rates else None


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _lines(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
            for row in (header, ["-" * w for w in widths], *rows)]


def detail_rows(records: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in records:
        t, memory = r.get("throughput"), r.get("memory") or {}
        if not t:
            continue
        kv = t["kv_used_mib_max"] if r["server"] != REFERENCE else r.get("kv_reserved_mib")
        rows.append([str(r["n"]), r["server"], _cell(t["tokens_per_s"]),
                     _cell(t["stream_tokens_per_s_median"]), _cell(t["ttft_ms_p50"], 0),
                     _cell(t["ttft_ms_p95"], 0), _cell(memory.get("rss_mib"), 0),
                     _cell(memory.get("peak_rss_mib"), 0), _cell(kv),
                     _cell(t["kv_blocks_used_max"], 0), str(t["tokens"])])
    return rows


def write_table(report: dict[str, Any], out: TextIO) -> None:
    """Every row, the ratios per N, the busy TTFTs and the failures."""
    records = report["rows"]
    header = ("N", "server", "tok/s", "stream tok/s", "TTFT p50", "TTFT p95", "RSS MiB",
              "peak RSS", "KV MiB", "KV blocks", "tokens")
    lines = _lines(header, detail_rows(records))
    lines += ["", "KV MiB: specserve's most held while the streams ran; llama-server's "
              "reserved at start-up", ""]
    ratio_header = ("N", *(f"{s} tok/s" for s in SERVERS), "none/llama", "specserve/llama",
                    "specserve/none")
    lines += _lines(ratio_header, [[str(r["n"]), *(_cell(r[f"{s}_tokens_per_s"])
                                                   for s in SERVERS),
                                    *(_cell(r[key], 2) for key, _, _ in RATIOS)]
                                   for r in report["ratios"]])
    for r in records:
        if b := r.get("busy_ttft"):
            lines.append(f"{r['server']}: time to first token with {b['busy_streams']} streams "
                         f"decoding: p50 {b['ttft_ms_p50']:.0f} ms, p95 {b['ttft_ms_p95']:.0f} "
                         f"ms ({b['probes']} requests)")
        if r.get("failure"):
            lines.append(f"{r['server']} N={r['n']} failed: {r['failure']}")
    out.write("\n".join(lines) + "\n")
    out.flush()


def write_plot(report: dict[str, Any], path: Path) -> Path | None:
    """Aggregate tokens/s against N, a line per server, as ``path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        from specbench.plots import MISSING

        log.warning("%s", MISSING)
        return None
    from specbench.plots import DPI

    figure = Figure(layout="constrained", figsize=(6.5, 4.2))
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    levels = [r["n"] for r in report["ratios"]]
    for server in SERVERS:
        points = [(r["n"], r[f"{server}_tokens_per_s"]) for r in report["ratios"]
                  if r[f"{server}_tokens_per_s"]]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=server)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.set(xlabel="concurrent streams N", ylabel="aggregate tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    machine = report["machine"]
    figure.suptitle(f"many users, {report['target']['given']}, {report['config']['threads']} "
                    f"threads, greedy, no max_tokens\n{machine.get('cpu', '')}", fontsize=9)
    figure.savefig(path, dpi=DPI)
    log.info("wrote %s", path)
    return path


def warn_if_busy(machine: dict[str, Any]) -> None:
    """Say so where other processes already load the machine: the numbers would be theirs too,
    llama-server's most (its threads wait for each other at every step)."""
    load, cpus = machine.get("load_average_1m_start"), machine.get("logical_cpus") or 1
    if load is not None and load > BUSY_LOAD * cpus:
        log.warning("load average %.1f on %d CPUs before the first server starts: other "
                    "processes compete with the servers; measure on a quiet machine", load, cpus)


def cpu_flags(record: dict[str, Any]) -> list[str]:
    flags = set(record.get("lscpu", {}).get("Flags", "").split())
    return [flag for flag in FLAGS_OF_NOTE if flag in flags]


# -- the command ----------------------------------------------------------------------------


def prepare(args: argparse.Namespace) -> tuple[list[str], Path | None, list[Prompt]]:
    """The servers, the target's GGUF file (for llama-server) and the prompts; a
    ``ValueError`` says what is wrong with the arguments."""
    args.streams = sorted({int(v) for v in args.streams.split(",") if v.strip()})
    if not args.streams or args.streams[0] < 1:
        raise ValueError("--streams takes positive integers, e.g. 1,2,4,8,16")
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in servers if s not in SERVERS]
    if unknown or not servers:
        raise ValueError(f"--servers takes some of {', '.join(SERVERS)}, not {unknown}")
    gguf = None
    if REFERENCE in servers:
        if shutil.which(args.llama_server) is None:
            raise ValueError(f"llama-server not found at {args.llama_server!r}: build llama.cpp "
                             "and pass --llama-server PATH")
        gguf = gguf_file(locate(args.target))
    sets = [s.strip() for s in args.prompt_sets.split(",") if s.strip()]
    prompts = [p for name in sets for p in load_prompts(name)]
    needed = max(max(args.streams), args.busy + 1 + args.probes)
    if len(prompts) < needed:
        log.warning("%d prompts for up to %d requests at once: some repeat", len(prompts),
                    needed)
    return servers, gguf, prompts


def run(args: argparse.Namespace) -> int:
    try:
        servers, gguf, prompts = prepare(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    json_path = json_output(args.json) or Path(DEFAULT_JSON)
    logs = json_path.with_name(json_path.stem + "-logs")
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, exit_on_signal)
    machine = machine_record(args.threads)
    machine["cpu_flags_of_note"] = cpu_flags(machine)
    warn_if_busy(machine)
    records = run_rounds(args, servers, gguf, prompts, logs)
    close_machine_record(machine)
    report = {"machine": machine, **versions(args.llama_server if gguf else None),
              "target": {"given": args.target, "file": str(gguf) if gguf else None},
              "config": config_of(args, prompts), "ratios": ratios(records), "rows": records}
    write_table(report, sys.stdout)
    json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    log.info("wrote %s", json_path)
    write_plot(report, json_path.with_suffix(".png"))
    return 1 if all(r.get("failure") for r in records) else 0


def config_of(args: argparse.Namespace, prompts: Sequence[Prompt]) -> dict[str, Any]:
    return {"streams": args.streams, "max_new_tokens": args.max_new, "max_tokens_sent": None,
            "threads": args.threads, "context_per_stream": args.context,
            "max_active": args.max_active, "busy_streams": args.busy, "probes": args.probes,
            "greedy": True, "prompt_sets": args.prompt_sets, "prompts": [p.id for p in prompts],
            "token_count": "the server's running count per chunk (llama-server "
                           "timings.predicted_n, specserve speculation rounds + "
                           "accepted_tokens, usage at a stream's end)"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specbench.many_users", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_peer_arguments(parser)
    parser.add_argument("--streams", default=DEFAULT_STREAMS,
                        help=f"comma-separated numbers of concurrent streams (default "
                             f"{DEFAULT_STREAMS})")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated, of {', '.join(SERVERS)} (default all)")
    parser.add_argument("--max-new", type=int, default=MAX_NEW,
                        help=f"tokens after which the client closes a stream (default "
                             f"{MAX_NEW}; never sent as max_tokens)")
    parser.add_argument("--prompt-sets", default=DEFAULT_SETS,
                        help=f"comma-separated held-out sets or prompt files (default "
                             f"{DEFAULT_SETS})")
    parser.add_argument("--busy", type=int, default=BUSY,
                        help=f"streams decoding while a new request's TTFT is timed (default "
                             f"{BUSY})")
    parser.add_argument("--probes", type=int, default=PROBES,
                        help=f"new requests timed while --busy streams decode (default "
                             f"{PROBES}; 0 leaves that measurement out)")
    parser.add_argument("--threads", type=int, default=THREADS,
                        help=f"threads of every server (default {THREADS})")
    parser.add_argument("--context", type=int, default=CONTEXT_PER_STREAM,
                        help=f"llama-server's context per slot: -c is N times it (default "
                             f"{CONTEXT_PER_STREAM})")
    parser.add_argument("--max-active", type=int, default=MAX_ACTIVE,
                        help=f"specserve's --max-active (default {MAX_ACTIVE}, its own)")
    parser.add_argument("--base-port", type=int, default=BASE_PORT,
                        help=f"the first port (default {BASE_PORT}); two more per server start")
    parser.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S,
                        help=f"seconds a server may take to load (default {START_TIMEOUT_S:.0f})")
    parser.add_argument("--json", default=DEFAULT_JSON,
                        help=f"write the results here, the plot and the servers' logs beside "
                             f"it (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
