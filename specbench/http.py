"""What the HTTP layer costs: one stream through ``specserve serve`` versus the
same engine called directly, time to first token, and aggregate throughput with
several concurrent streams. Prints a table and writes JSON.

    python -m specbench.http --threads 1 --json bench-results/http.json

The server runs as a separate process (as in production) with the same model,
drafter and thread count as the in-process engine; direct and HTTP runs
alternate so that background load affects both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from decoding.engine import Engine
from decoding.prompting import encode_text
from decoding.types import GenerationRequest, SamplingParams
from gateway.server import build_engine
from gateway.service.settings import Settings

log = logging.getLogger(__name__)

PROMPT = ("Here is a long list of fruits, one per line, each with a short description of its "
          "taste and colour:\n1. Apple:")
READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Sample:
    ttft_s: float  # request sent -> first text
    seconds: float  # request sent -> last event
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


# -- one request, two ways ------------------------------------------------------------------


async def direct_once(engine: Engine, prompt_ids: tuple[int, ...], max_tokens: int) -> Sample:
    start = time.perf_counter()
    stream = engine.submit(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=max_tokens,
                                             sampling=SamplingParams(temperature=0.0)))
    first: float | None = None
    tokens = 0
    async for event in stream:
        if first is None and event.text:
            first = time.perf_counter() - start
        tokens = event.completion_tokens
    elapsed = time.perf_counter() - start
    return Sample(first if first is not None else elapsed, elapsed, tokens)


async def http_once(client: httpx.AsyncClient, model: str, max_tokens: int) -> Sample:
    payload = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    elapsed = time.perf_counter() - start
    return Sample(first if first is not None else elapsed, elapsed, tokens)


async def concurrent(run_one: Callable[[], Awaitable[Sample]], streams: int
                     ) -> dict[str, float]:
    start = time.perf_counter()
    samples = await asyncio.gather(*(run_one() for _ in range(streams)))
    wall = time.perf_counter() - start
    tokens = sum(s.tokens for s in samples)
    return {"streams": streams, "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2),
            "median_ttft_s": round(statistics.median(s.ttft_s for s in samples), 4)}


# -- the server process -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "specserve.cli", "serve", "--target", args.target,
               "--draft", args.draft, "--dtype", args.dtype, "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning", "--max-tokens",
               str(args.tokens), "--max-active", str(max(args.concurrency))]
    if args.threads:
        command += ["--threads", str(args.threads)]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SPECSERVE_") or k == "SPECSERVE_HOME"}
    return subprocess.Popen(command, env=env)


def wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


# -- the benchmark ------------------------------------------------------------------------


async def run(engine: Engine, url: str, args: argparse.Namespace) -> dict[str, Any]:
    prompt_ids = tuple(encode_text(engine.target.tokenizer, PROMPT))
    model = (await _model_id(url))
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await direct_once(engine, prompt_ids, 8)  # warm both paths
        await http_once(client, model, 8)
        direct: list[Sample] = []
        via_http: list[Sample] = []
        for _ in range(args.repeats):
            direct.append(await direct_once(engine, prompt_ids, args.tokens))
            via_http.append(await http_once(client, model, args.tokens))
        scaling = []
        for streams in args.concurrency:
            scaling.append({
                "direct": await concurrent(
                    lambda: direct_once(engine, prompt_ids, args.tokens), streams),
                "http": await concurrent(lambda: http_once(client, model, args.tokens),
                                         streams),
            })
    return {"single": {"direct": _summary(direct), "http": _summary(via_http),
                       "samples": {"direct": [asdict(s) for s in direct],
                                   "http": [asdict(s) for s in via_http]}},
            "concurrency": scaling}


async def _model_id(url: str) -> str:
    async with httpx.AsyncClient(base_url=url) as client:
        return str((await client.get("/v1/models")).json()["data"][0]["id"])


def _summary(samples: list[Sample]) -> dict[str, float]:
    return {
        "median_tokens_per_s": round(statistics.median(s.tokens_per_s for s in samples), 2),
        "median_ttft_s": round(statistics.median(s.ttft_s for s in samples), 4),
        "tokens": samples[0].tokens,
    }


def print_table(result: dict[str, Any]) -> None:
    single = result["single"]
    d, h = single["direct"], single["http"]
    ratio = h["median_tokens_per_s"] / d["median_tokens_per_s"]
    rows = [
        ("one stream, direct engine", f"{d['median_tokens_per_s']:.1f}",
         f"{d['median_ttft_s'] * 1000:.1f}", ""),
        ("one stream, HTTP (SSE)", f"{h['median_tokens_per_s']:.1f}",
         f"{h['median_ttft_s'] * 1000:.1f}", f"{ratio:.3f}x"),
    ]
    for level in result["concurrency"]:
        for kind in ("direct", "http"):
            row = level[kind]
            rows.append((f"{row['streams']} streams, {kind}", f"{row['tokens_per_s']:.1f}",
                         f"{row['median_ttft_s'] * 1000:.1f}", ""))
    print(f"{'run':<28} {'tokens/s':>10} {'TTFT ms':>10} {'HTTP/direct':>12}")
    for name, rate, ttft, rel in rows:
        print(f"{name:<28} {rate:>10} {ttft:>10} {rel:>12}")
    added = (h["median_ttft_s"] - d["median_ttft_s"]) * 1000
    print(f"time to first token added by HTTP: {added:.1f} ms; "
          f"tokens per request: {d['tokens']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specbench.http", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="PyTorch CPU threads")
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens per request")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--json", default="bench-results/http.json")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    logging.basicConfig(level=logging.WARNING)

    settings = Settings(target=args.target, draft=args.draft, dtype=args.dtype,
                        threads=args.threads, max_active=max(args.concurrency))
    engine = build_engine(settings)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port)
    try:
        wait_ready(url, proc)
        result = asyncio.run(run(engine, url, args))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        engine.shutdown()
    result["config"] = {"target": args.target, "draft": args.draft, "dtype": args.dtype,
                        "threads": args.threads, "tokens": args.tokens,
                        "repeats": args.repeats, "cpus": os.cpu_count(),
                        "load_average": os.getloadavg()}
    print_table(result)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
