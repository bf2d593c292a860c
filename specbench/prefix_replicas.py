"""Two ``specserve serve`` replicas sharing one Redis: the second replica's time to
first token on a prefix the first replica cached, against its own uncached TTFT.
Used by ``specbench.prefix_cache``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

MODEL = "bench"
START_TIMEOUT_S = 600.0
REPO = Path(__file__).resolve().parent.parent


def rules(prefix_tokens: int, nonce: str, tokenizer: Any) -> str:
    """A system prompt of numbered house rules, about ``prefix_tokens`` tokens long,
    starting with ``nonce`` (so that prompts with different nonces share no block)."""
    text = f"Session {nonce}. You are the front desk assistant of a seaside hotel."
    i = 0
    while len(tokenizer.encode(text)) < prefix_tokens:
        text += "".join(f" Rule {j}: a guest in room {100 + j} has breakfast on floor "
                        f"{j % 7} and may check out at {1 + j % 11} pm." for j in range(i, i + 20))
        i += 20
    ids = tokenizer.encode(text)[:prefix_tokens]
    return str(tokenizer.decode(ids))


def chat(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def redis_url_or_local(url: str | None) -> Iterator[str]:
    """``url``, or a throwaway redis-server on a free loopback port."""
    if url:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("no --redis-url and no redis-server installed")
    port = _free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        _wait(lambda: _redis(f"redis://127.0.0.1:{port}/0").ping(), 10)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.kill()
        process.wait()


def _redis(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url)


def _wait(ready: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ready():
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError("not ready in time")
        time.sleep(0.2)


@contextmanager
def replica(model_dir: str, redis_url: str) -> Iterator[dict[str, str]]:
    """A replica starting (see ``ready``); killed at the end."""
    port, metrics = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")
           or k == "SPECSERVE_HOME"}
    command = [sys.executable, "-m", "specserve.cli", "serve", "--target", model_dir,
               "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
               "--metrics-port", str(metrics), "--redis-url", redis_url, "--draft", "ngram",
               "--log-level", "warning"]
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, text=True)
        try:
            url = f"http://127.0.0.1:{port}"
            yield {"url": url, "metrics": f"http://127.0.0.1:{metrics}/metrics"}
        finally:
            process.kill()
            process.wait(timeout=30)


def ready(server: dict[str, str]) -> None:
    _wait(lambda: httpx.get(f"{server['url']}/ready").status_code == 200, START_TIMEOUT_S)


def ttft(url: str, messages: list[dict[str, str]]) -> tuple[float, int]:
    """Seconds to the first streamed chunk, and the prompt tokens the server reused."""
    payload = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    cached = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - start
            usage = json.loads(line[6:]).get("usage")
            if usage:
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    assert first is not None, "no chunk came back"
    return first, cached


def _counters(*metrics_urls: str) -> dict[str, float]:
    """The prefix cache's counters, summed over the replicas."""
    names = {"cache_errors": "specserve_cache_errors_total",
             "reads_cut": "specserve_prefix_cache_reads_cut_total",
             "fetched_bytes": "specserve_prefix_cache_fetched_bytes_total"}
    out = dict.fromkeys(names, 0.0)
    for url in metrics_urls:
        for line in httpx.get(url).text.splitlines():
            for key, name in names.items():
                if line.startswith(name + "{"):
                    out[key] += float(line.split()[-1])
    return out


def _settled(redis_url: str) -> None:
    """Wait until the first replica's background writes have landed (key count steady)."""
    client = _redis(redis_url)
    last, since = -1, time.monotonic()
    while time.monotonic() - since < 1.0:
        count = int(client.dbsize())
        if count != last:
            last, since = count, time.monotonic()
        time.sleep(0.1)


def replica_rows(model_dir: str, redis_url: str, sizes: list[int]) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    with ExitStack() as stack:
        first = stack.enter_context(replica(model_dir, redis_url))
        second = stack.enter_context(replica(model_dir, redis_url))
        ready(first)  # both started side by side
        ready(second)
        ttft(first["url"], chat("warm up", "hello"))
        ttft(second["url"], chat("warm up", "hello"))
        for size in sizes:
            shared = rules(size, uuid.uuid4().hex[:8], tokenizer)
            own = rules(size, uuid.uuid4().hex[:8], tokenizer)
            before = _counters(first["metrics"], second["metrics"])
            first_s, _ = ttft(first["url"], chat(shared, "Breakfast for room 142?"))
            _settled(redis_url)
            uncached, _ = ttft(second["url"], chat(own, "Breakfast for room 142?"))
            cached, reused = ttft(second["url"], chat(shared, "Checkout for room 117?"))
            after = _counters(first["metrics"], second["metrics"])
            rows.append({"case": "replicas", "store": "redis", "load": "quiet",
                         "prefix_tokens": size, "cached_tokens": reused,
                         "first_replica_s": first_s, "uncached_s": uncached, "cached_s": cached,
                         "ratio": cached / uncached,
                         **{k: int(after[k] - before[k]) for k in after}})
            print(rows[-1], file=sys.stderr, flush=True)
    return rows
