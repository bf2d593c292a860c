"""Time to first token with a cached prompt prefix, and repeated requests with
continuation drafts, against the default model; in process and through Redis.

    python specbench/prefix_cache.py [--redis-url URL] [--prefix-tokens 2000] [--json PATH]

Prints a table and writes JSON. Ratios are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from decoding import model_store
from decoding.drafters.combined import CombinedDrafter
from decoding.drafters.continuation import ContinuationDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.factory import load_target
from decoding.prefix_cache import InProcessStore, PrefixCache, PrefixStore
from decoding.prompting import encode_chat
from decoding.sequence import decode
from decoding.target import CausalLM
from decoding.types import GenerationRequest, SamplingParams

SYSTEM = (
    "You are the support assistant of a company that rents out bicycles in a coastal town. "
    "Answer briefly and politely. Policies: rentals start at nine in the morning and end at "
    "seven in the evening; helmets are free; electric bicycles need a deposit; children under "
    "twelve ride with an adult; a flat tyre is repaired free of charge during the rental. "
)


def _prompt(target: CausalLM, prefix_tokens: int, question: str) -> tuple[int, ...]:
    system = SYSTEM
    while len(target.tokenizer.encode(system)) < prefix_tokens:
        system += SYSTEM
    return tuple(encode_chat(target.tokenizer, [{"role": "system", "content": system},
                                                {"role": "user", "content": question}]))


def _ttft(target: CausalLM, prompt: tuple[int, ...], cache: PrefixCache | None) -> float:
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=1,
                                sampling=SamplingParams(temperature=0.0))
    start = time.perf_counter()
    for _ in decode(target, None, request, prefix_cache=cache):
        pass
    return time.perf_counter() - start


def _median(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def _stores(redis_url: str | None) -> dict[str, PrefixStore]:
    stores: dict[str, PrefixStore] = {"in-process": InProcessStore(max_bytes=2 << 30)}
    if redis_url:
        from gateway.redis_store import RedisStore

        stores["redis"] = RedisStore(redis_url, timeout_s=2.0)
    return stores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench-results/prefix_cache.json")
    args = parser.parse_args()
    target = load_target("default")
    namespace = f"{model_store.revision(model_store.resolve('default'))}-{uuid.uuid4().hex}"
    rows = []
    questions = iter(f"Question {i}: can I rent a bike at eight in the morning?" for i in range(99))
    uncached = _median(lambda: _ttft(target, _prompt(target, args.prefix_tokens, next(questions)),
                                     None), args.repeats)
    prompt_len = len(_prompt(target, args.prefix_tokens, "x"))
    rows.append({"case": "ttft", "store": "none", "prompt_tokens": prompt_len,
                 "seconds": uncached, "ratio": 1.0})
    for name, store in _stores(args.redis_url).items():
        cache = PrefixCache(store, namespace + name, block_tokens=64)
        _ttft(target, _prompt(target, args.prefix_tokens, "warm the shared prefix"), cache)
        hit = _median(lambda c=cache: _ttft(  # type: ignore[misc]
            target, _prompt(target, args.prefix_tokens, next(questions)), c), args.repeats)
        rows.append({"case": "ttft", "store": name, "prompt_tokens": prompt_len,
                     "seconds": hit, "ratio": hit / uncached})
    rows.extend(_continuation_rows(target, namespace))
    _print(rows)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"prefix_tokens": args.prefix_tokens, "rows": rows}, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _continuation_rows(target: CausalLM, namespace: str) -> list[dict[str, object]]:
    cache = PrefixCache(InProcessStore(), namespace + "continuation", block_tokens=64)
    prompt = tuple(encode_chat(target.tokenizer, [
        {"role": "user", "content": "Write a short story about a lighthouse keeper."}]))
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=128,
                                sampling=SamplingParams(temperature=0.0))
    rows: list[dict[str, object]] = []
    drafters = {
        "plain": None,
        "ngram": NgramDrafter(),
        "ngram+cache (repeat)": CombinedDrafter(
            [NgramDrafter(), ContinuationDrafter(cache, target.vocab_size)]),
    }
    for _ in decode(target, None, request, prefix_cache=cache):  # first run fills the cache
        pass
    base = 0.0
    for name, drafter in drafters.items():
        start = time.perf_counter()
        tokens = sum(len(e.token_ids) for e in decode(target, drafter, request))
        rate = tokens / (time.perf_counter() - start)
        base = base or rate
        rows.append({"case": "repeat-request", "store": name, "tokens_per_s": rate,
                     "ratio": rate / base})
    return rows


def _print(rows: list[dict[str, object]]) -> None:
    print(f"{'case':<16}{'store/drafter':<24}{'value':>12}{'ratio':>8}")
    for row in rows:
        if "seconds" in row:
            value = f"{float(row['seconds']) * 1000:.0f} ms"  # type: ignore[arg-type]
        else:
            value = f"{float(row['tokens_per_s']):.1f} t/s"  # type: ignore[arg-type]
        print(f"{row['case']!s:<16}{row['store']!s:<24}{value:>12}{float(row['ratio']):>8.2f}")  # type: ignore[arg-type]


if __name__ == "__main__":
    raise SystemExit(main())
