"""Prefix KV reuse and continuation drafts, in process and on a real Redis."""

from __future__ import annotations

import socket
import struct
import threading
import uuid
from collections.abc import Iterator

import pytest
import redis

from decoding.drafter import DraftContext
from decoding.prefix_cache import CONTEXT_TOKENS, InProcessStore, PrefixCache, PrefixStore
from decoding.prompting import encode_text
from decoding.round import decode
from decoding.types import GenerationRequest, RoundEvent, SamplingParams
from drafters.continuation import ContinuationDrafter
from gateway.service.redis_store import KEY_PREFIX, RedisStore
from runtime.runner.causal_lm import CausalLM
from tests.clocks import ManualClock
from tests.conftest import RedisServer
from tests.gateway.conftest import wait_until
from tests.policies import SteadyTimingPolicy

GREEDY = SamplingParams(temperature=0.0)
BLOCK = 16
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp "
    "and a notebook in which he recorded the wind, the tide and the ships that passed. "
)


def _cache(store: PrefixStore) -> PrefixCache:
    return PrefixCache(store, namespace=f"test-{uuid.uuid4().hex}", block_tokens=BLOCK)


def _ids(target: CausalLM, text: str) -> tuple[int, ...]:
    return tuple(encode_text(target.tokenizer, text))


def _run(target: CausalLM, prompt: tuple[int, ...], cache: PrefixCache | None,
         drafter: ContinuationDrafter | None = None, n: int = 24) -> list[RoundEvent]:
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=n, sampling=GREEDY)
    # draft lengths from fixed timings: measured ones made a loaded machine draft less
    return list(decode(target, drafter, request, SteadyTimingPolicy(), prefix_cache=cache))


def _tokens(events: list[RoundEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_in_process_lru_respects_its_byte_bound() -> None:
    store = InProcessStore(max_bytes=1000)
    store.put_many([(b"a", b"x" * 400), (b"b", b"x" * 400)])
    assert store.get_many([b"a"]) == [b"x" * 400]  # a is now the most recent
    store.put_many([(b"c", b"x" * 400)])
    assert store.get_many([b"a", b"b", b"c"]) == [b"x" * 400, None, b"x" * 400]
    assert store.size_bytes <= 1000


def test_in_process_ttl_expires() -> None:
    clock = ManualClock()
    store = InProcessStore(ttl_s=5.0, clock=clock)
    store.put_many([(b"k", b"v")])
    clock.advance(5.0)
    assert store.get_many([b"k"]) == [b"v"]  # at its time to live, not past it
    clock.advance(0.5)
    assert store.get_many([b"k"]) == [None]
    assert store.size_bytes == 0


def test_block_keys_chain_on_the_whole_prefix() -> None:
    cache = _cache(InProcessStore())
    a = cache.block_keys(list(range(64)))
    b = cache.block_keys([*range(16), 99, *range(17, 64)])  # differs in block 1
    assert len(a) == 4 and a[0] == b[0] and a[1] != b[1] and a[3] != b[3]
    other_model = PrefixCache(cache.store, namespace="another-model", block_tokens=BLOCK)
    assert other_model.block_keys(list(range(64)))[0] != a[0]


def test_prefix_hit_is_token_identical(tiny_target: CausalLM) -> None:
    cache = _cache(InProcessStore())
    prompt = _ids(tiny_target, PASSAGE * 3)
    cold = _run(tiny_target, prompt, None)
    first = _run(tiny_target, prompt, cache)
    second = _run(tiny_target, prompt, cache)
    assert first[0].cached_tokens == 0
    assert second[0].cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK > 0
    assert _tokens(first) == _tokens(second) == _tokens(cold)
    assert cache.stats.hits == 1 and cache.stats.hit_tokens == second[0].cached_tokens


def test_longest_prefix_across_block_boundaries(tiny_target: CausalLM) -> None:
    cache = _cache(InProcessStore())
    base = _ids(tiny_target, PASSAGE * 3)
    _run(tiny_target, base, cache, n=2)
    shared = 2 * BLOCK + 5  # diverges inside block 2
    other = (*base[:shared], *_ids(tiny_target, " A different ending about the sea."))
    events = _run(tiny_target, other, cache)
    assert events[0].cached_tokens == 2 * BLOCK
    assert _tokens(events) == _tokens(_run(tiny_target, other, None))


def test_corrupt_value_is_a_miss(tiny_target: CausalLM) -> None:
    store = InProcessStore()
    cache = _cache(store)
    prompt = _ids(tiny_target, PASSAGE * 2)
    expected = _tokens(_run(tiny_target, prompt, cache))
    keys = cache.block_keys(prompt[:-1])
    value = store.get_many([keys[1]])[0]
    assert value is not None
    store.put_many([(keys[1], value[:100] + bytes([value[100] ^ 0xFF]) + value[101:])])
    events = _run(tiny_target, prompt, cache)
    assert events[0].cached_tokens == BLOCK  # block 0 still good, block 1 rejected
    assert cache.stats.errors == 1
    assert _tokens(events) == expected


def test_continuation_drafts_repeat_earlier_work(tiny_target: CausalLM) -> None:
    cache = _cache(InProcessStore())
    drafter = ContinuationDrafter(cache, tiny_target.vocab_size)
    prompt = _ids(tiny_target, "Write the alphabet: a b c")
    plain = _tokens(_run(tiny_target, prompt, None, n=40))
    first = _run(tiny_target, prompt, cache, drafter, n=40)
    again = _run(tiny_target, prompt, cache, drafter, n=40)
    assert _tokens(first) == _tokens(again) == plain
    assert sum(e.accepted_tokens for e in first) == 0
    assert sum(e.accepted_tokens for e in again) >= 30
    assert len(again) < len(first) / 3


def test_corrupt_continuation_is_a_miss_and_proposes_nothing(tiny_target: CausalLM) -> None:
    store = InProcessStore()
    cache = _cache(store)
    drafter = ContinuationDrafter(cache, tiny_target.vocab_size)
    prompt = _ids(tiny_target, PASSAGE)
    _run(tiny_target, prompt, cache, drafter, n=8)
    context = DraftContext(token_ids=prompt, sampling=GREEDY, generator=None)
    remembered = drafter.propose(None, context, k=8).tokens
    assert len(remembered) == 8  # what followed the prompt is remembered
    key = cache.continuation_key(prompt[-CONTEXT_TOKENS:])
    value = store.get_many([key])[0]
    assert value is not None
    (count,) = struct.unpack_from("<I", value)
    stored = struct.unpack_from(f"<{count}I", value, 4)
    assert stored[:8] == remembered
    # other in-vocabulary tokens in place of the stored ones: the count and every length
    # still agree, only the checksum after the tokens can tell
    forged = struct.pack(f"<{count}I", *((t + 1) % tiny_target.vocab_size for t in stored))
    store.put_many([(key, value[:4] + forged + value[4 + len(forged):])])
    errors, hits = cache.stats.errors, cache.stats.continuation_hits
    assert cache.continuation(prompt) == ()
    assert drafter.propose(None, context, k=8).tokens == ()
    assert cache.stats.errors == errors + 2
    assert cache.stats.continuation_hits == hits


# -- Redis -------------------------------------------------------------------------


def test_redis_shared_by_two_instances(tiny_target: CausalLM, redis_url: str) -> None:
    namespace = f"shared-{uuid.uuid4().hex}"
    replica_a = PrefixCache(RedisStore(redis_url), namespace, block_tokens=BLOCK)
    replica_b = PrefixCache(RedisStore(redis_url), namespace, block_tokens=BLOCK)
    prompt = _ids(tiny_target, PASSAGE * 3)
    a = _run(tiny_target, prompt, replica_a)
    assert replica_a.store.flush()
    b = _run(tiny_target, prompt, replica_b)
    assert a[0].cached_tokens == 0 and b[0].cached_tokens > 0
    assert _tokens(a) == _tokens(b)
    assert replica_b.stats.hits == 1 and replica_b.stats.errors == 0


def test_redis_blocks_carry_the_time_to_live(tiny_target: CausalLM, redis_url: str) -> None:
    cache = PrefixCache(RedisStore(redis_url, ttl_s=600), f"ttl-{uuid.uuid4().hex}", BLOCK)
    prompt = _ids(tiny_target, PASSAGE * 2)
    _run(tiny_target, prompt, cache, n=2)
    assert cache.store.flush()
    assert _run(tiny_target, prompt, cache, n=2)[0].cached_tokens > 0
    client = redis.Redis.from_url(redis_url)
    ttls = [client.pttl(KEY_PREFIX + key) for key in cache.block_keys(prompt[:-1])]
    assert ttls and all(0 < ttl <= 600_000 for ttl in ttls), ttls


def test_redis_ttl_expires(tiny_target: CausalLM, redis_url: str) -> None:
    cache = PrefixCache(RedisStore(redis_url, ttl_s=1), f"ttl-{uuid.uuid4().hex}", BLOCK)
    prompt = _ids(tiny_target, PASSAGE * 2)
    _run(tiny_target, prompt, cache, n=2)
    assert cache.store.flush()
    keys = [KEY_PREFIX + key for key in cache.block_keys(prompt[:-1])]
    client = redis.Redis.from_url(redis_url)
    # Redis's own clock expires the blocks; the ceiling is there only for a hang
    assert wait_until(lambda: client.exists(*keys) == 0, timeout=60)
    assert _run(tiny_target, prompt, cache, n=2)[0].cached_tokens == 0


def test_redis_eviction_under_its_memory_cap(tiny_target: CausalLM) -> None:
    server = RedisServer("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    server.start()
    try:
        store = RedisStore(server.url)
        cache = PrefixCache(store, f"cap-{uuid.uuid4().hex}", BLOCK)
        prompts = [_ids(tiny_target, f"Story number {i}. " + PASSAGE * 5) for i in range(60)]
        for prompt in prompts:
            _run(tiny_target, prompt, cache, n=1)
        assert store.flush()
        # newest first: a lookup that misses stores its blocks again and evicts others
        hits = []
        for p in prompts[::-1]:
            hits.append(_run(tiny_target, p, cache, n=1)[0].cached_tokens > 0)
            assert store.flush()
        assert hits[0], "the most recent prompt is still cached"
        assert not all(hits), "older prompts were evicted to respect maxmemory"
        assert store.stats.errors == 0
    finally:
        server.stop()


def test_redis_killed_and_restarted(tiny_target: CausalLM, redis_server: RedisServer) -> None:
    clock = ManualClock()  # the circuit's time: open until the test moves it on
    store = RedisStore(redis_server.url, circuit_open_s=0.2, clock=clock)
    cache = PrefixCache(store, f"fault-{uuid.uuid4().hex}", BLOCK)
    prompt = _ids(tiny_target, PASSAGE * 2)
    expected = _tokens(_run(tiny_target, prompt, None))
    assert _tokens(_run(tiny_target, prompt, cache)) == expected
    assert store.flush()
    redis_server.stop()
    for _ in range(3):
        assert _tokens(_run(tiny_target, prompt, cache)) == expected
    assert store.stats.errors >= 1
    redis_server.start()  # same port, empty
    clock.advance(0.3)  # the circuit closes
    assert _tokens(_run(tiny_target, prompt, cache)) == expected  # miss, then stored again
    assert store.flush()
    assert _run(tiny_target, prompt, cache)[0].cached_tokens > 0, "reconnected by itself"


@pytest.fixture()
def silent_server() -> Iterator[str]:
    """A TCP server that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_redis_that_never_answers(tiny_target: CausalLM, silent_server: str) -> None:
    # the circuit's clock stands still: once open, it stays open however slow the runs
    store = RedisStore(silent_server, timeout_s=0.05, circuit_open_s=10, clock=ManualClock())
    cache = PrefixCache(store, "silent", BLOCK)
    prompt = _ids(tiny_target, PASSAGE * 2)
    expected = _tokens(_run(tiny_target, prompt, None))
    for _ in range(3):
        assert _tokens(_run(tiny_target, prompt, cache)) == expected
    assert store.get_many(cache.block_keys(prompt)) == [None] * len(cache.block_keys(prompt))
    # a read that went to Redis would have timed out again and counted a second error
    assert store.stats.errors == 1, "one timeout, then the circuit skips Redis"
