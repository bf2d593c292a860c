"""Time to first token with a cached prompt prefix, against the default model:
2k- and 8k-token prefixes, cached in process and through Redis, on a quiet
engine and with two other streams decoding; then two ``specserve serve``
replicas sharing one Redis (the second on a prefix the first cached).

    python -m specbench.prefix_cache [--redis-url URL] [--prefix-tokens 2048,7900]
        [--loads quiet,busy] [--cases engine,replicas,compression] [--json PATH]

Without ``--redis-url`` a throwaway redis-server is started (if installed).
Every cached TTFT is divided by the uncached TTFT measured right before it
under the same conditions (same engine, same load); a fresh nonce at the start
of the system prompt makes the uncached request share no block with anything
cached. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from decoding.engine import Engine
from decoding.prefix_cache import InProcessStore, PrefixCache, PrefixStore
from decoding.prompting import encode_chat
from decoding.types import GenerationRequest, SamplingParams
from runtime.files import model_store
from runtime.loaders.loading import load_target
from runtime.runner.causal_lm import CausalLM
from specbench.prefix_replicas import chat, redis_url_or_local, replica_rows, rules

GREEDY = SamplingParams(temperature=0.0)
BUSY_STREAMS = 2


def _ttft(engine: Engine, prompt: tuple[int, ...]) -> tuple[float, int]:
    """Seconds from submit to the first token, and the prompt tokens reused."""
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=2, sampling=GREEDY)
    start = time.perf_counter()
    stream = engine.submit(request)
    events = iter(stream)
    first = next(events)
    seconds = time.perf_counter() - start
    for _ in events:
        pass
    return seconds, first.cached_tokens


@contextmanager
def busy(engine: Engine, streams: int) -> Iterator[None]:
    """``streams`` long greedy generations decoding on the engine meanwhile."""
    prompt = tuple(encode_chat(engine.target.tokenizer, [
        {"role": "user", "content": "Tell a very long story about a lighthouse keeper."}]))
    running = [engine.submit(GenerationRequest(prompt_ids=prompt, max_new_tokens=6000,
                                               sampling=GREEDY)) for _ in range(streams)]
    threads = [threading.Thread(target=lambda s=s: [None for _ in s], daemon=True)
               for s in running]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.0)  # they are past their prefill and decoding
        yield
    finally:
        for stream in running:
            stream.cancel()
        for thread in threads:
            thread.join(timeout=60)


def engine_rows(target: CausalLM, stores: dict[str, PrefixStore], sizes: list[int],
                loads: list[str]) -> list[dict[str, Any]]:
    """Per prefix size and load: one uncached request (a miss costs the same whatever
    the store), its blocks copied to every store, then one cached request per store."""
    namespace = f"bench-{uuid.uuid4().hex}"
    caches = {name: PrefixCache(store, namespace) for name, store in stores.items()}
    engine = Engine(target, max_active=BUSY_STREAMS + 1)
    engine.warmup()  # as a server does: no first-use kernel setup inside a measurement
    engine.start()
    rows = []
    try:
        for size in sizes:
            for load in loads:
                with busy(engine, BUSY_STREAMS if load == "busy" else 0):
                    rows += _pairs(engine, caches, size, load)
                for row in rows[-len(caches):]:
                    print(_line(row), file=sys.stderr, flush=True)
    finally:
        engine.shutdown()
    return rows


def _pairs(engine: Engine, caches: dict[str, PrefixCache], size: int, load: str
           ) -> list[dict[str, Any]]:
    tokenizer = engine.target.tokenizer
    system = rules(size, uuid.uuid4().hex[:8], tokenizer)
    first = next(iter(caches.values()))
    engine.prefix_cache = first  # read when a request is admitted
    uncached, _ = _ttft(engine, tuple(encode_chat(
        tokenizer, chat(system, "Which floor is breakfast on for room 142?"))))
    prompt = tuple(encode_chat(tokenizer, chat(system, "When can room 117 check out?")))
    keys = first.block_keys(prompt[:-1])
    blocks = [(k, v) for k, v in zip(keys, first.store.get_many(keys), strict=True) if v]
    rows = []
    for name, cache in caches.items():
        if cache is not first:
            cache.store.put_many(blocks)
        cache.store.flush()
        before = _counts(cache)
        engine.prefix_cache = cache
        cached, reused = _ttft(engine, prompt)
        after = _counts(cache)
        rows.append({"case": "engine", "store": name, "load": load, "prefix_tokens": size,
                     "prompt_tokens": len(prompt), "cached_tokens": reused,
                     "uncached_s": uncached, "cached_s": cached, "ratio": cached / uncached,
                     **{k: after[k] - before[k] for k in after}})
    return rows


def _counts(cache: PrefixCache) -> dict[str, int]:
    s = cache.stats
    return {"cache_errors": s.errors, "reads_cut": s.reads_cut, "fetched_bytes": s.fetched_bytes}


def _line(row: dict[str, Any]) -> str:
    where = f"{row['case']}/{row['store']}/{row.get('load', 'quiet')}"
    return (f"{where:<26}{row['prefix_tokens']:>8}{row['cached_tokens']:>8}"
            f"{row['uncached_s'] * 1000:>11.0f}{row['cached_s'] * 1000:>10.0f}"
            f"{row['ratio']:>7.3f}{row['cache_errors']:>7}{row['reads_cut']:>5}"
            f"{row['fetched_bytes'] / 1e6:>9.0f}")


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"{'case/store/load':<26}{'prefix':>8}{'reused':>8}{'uncached':>11}{'cached':>10}"
          f"{'ratio':>7}{'errors':>7}{'cut':>5}{'MB read':>9}")
    for row in rows:
        if row["case"] != "compression":
            print(_line(row))
    print(f"\n{'codec':<12}{'MB stored':>10}{'encode':>9}{'fetch':>9}{'ratio':>7}")
    for row in rows:
        if row["case"] == "compression":
            print(f"{row['codec']:<12}{row['bytes'] / 1e6:>10.1f}{row['encode_s'] * 1000:>7.0f}ms"
                  f"{row['fetch_s'] * 1000:>7.0f}ms{row['ratio']:>7.2f}")


def compression_rows(target: CausalLM, redis_url: str, tokens: int = 2048
                     ) -> list[dict[str, Any]]:
    """The fetch of a prefix's real KV blocks from Redis, raw against zlib-compressed
    (decompression included): lossless compression pays only if this is faster."""
    import zlib

    from gateway.service.redis_store import RedisStore

    store = InProcessStore(max_bytes=4 << 30)
    cache = PrefixCache(store, f"zlib-{uuid.uuid4().hex}")
    prompt = tuple(encode_chat(target.tokenizer, chat(rules(tokens, "z", target.tokenizer), "?")))
    engine = Engine(target, prefix_cache=cache)
    engine.start()
    try:
        _ttft(engine, prompt)
    finally:
        engine.shutdown()
    keys = cache.block_keys(prompt[:-1])
    raw = [v for v in store.get_many(keys) if v is not None]
    redis = RedisStore(redis_url)
    rows: list[dict[str, Any]] = []
    for level in (None, 1, 6):
        start = time.perf_counter()
        values = raw if level is None else [zlib.compress(v, level) for v in raw]
        encode_s = time.perf_counter() - start
        names = [f"zlib{level}-{uuid.uuid4().hex}".encode() for _ in values]
        redis.put_many(list(zip(names, values, strict=True)))
        redis.flush()
        start = time.perf_counter()
        got = redis.get_many(names)
        if level is not None:
            got = [zlib.decompress(v) for v in got if v is not None]
        fetch_s = time.perf_counter() - start
        assert got == raw, "the round trip changed the blocks"
        rows.append({"case": "compression", "codec": "none" if level is None else f"zlib-{level}",
                     "bytes": sum(len(v) for v in values), "raw_bytes": sum(len(v) for v in raw),
                     "encode_s": encode_s, "fetch_s": fetch_s})
    for row in rows:
        row["ratio"] = row["fetch_s"] / rows[0]["fetch_s"]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--prefix-tokens", default="2048,7900",
                        help="prefix sizes, comma separated (the model's context is 8192)")
    parser.add_argument("--loads", default="quiet,busy")
    parser.add_argument("--stores", default="in-process,redis")
    parser.add_argument("--cases", default="engine,replicas,compression")
    parser.add_argument("--json", default="bench-results/prefix_cache.json")
    args = parser.parse_args()
    sizes = [int(s) for s in args.prefix_tokens.split(",")]
    loads = args.loads.split(",")
    wanted = args.stores.split(",")
    with redis_url_or_local(args.redis_url) as redis_url:
        from gateway.service.redis_store import RedisStore

        stores: dict[str, PrefixStore] = {}
        if "in-process" in wanted:
            stores["in-process"] = InProcessStore(max_bytes=4 << 30)
        if "redis" in wanted:
            stores["redis"] = RedisStore(redis_url)  # the server's defaults
        cases = args.cases.split(",")
        rows = []
        if "replicas" in cases:
            rows += replica_rows(model_store.resolve("default"), redis_url, sizes)
        target = load_target("default")
        if "engine" in cases:
            rows += engine_rows(target, stores, sizes, loads)
        if "compression" in cases:
            rows += compression_rows(target, redis_url)
    _print(rows)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"prefix_tokens": sizes, "rows": rows}, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
