"""Long prefixes through a real Redis: reads that are slow or stall part way are
cut at a block boundary and keep what they read, and a 2k-token prefix hits
while another stream keeps the engine busy, with identical output."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from decoding.engine import Engine
from decoding.prefix_cache import PrefixCache
from decoding.prompting import encode_chat, encode_text
from decoding.round import decode
from decoding.types import GenerationRequest, RoundEvent, SamplingParams
from gateway.service.redis_store import RedisStore
from runtime.runner.causal_lm import CausalLM
from tests.clocks import ManualClock
from tests.conftest import RedisServer

GREEDY = SamplingParams(temperature=0.0)
BLOCK = 16
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
           "lamp and a notebook in which he recorded the wind, the tide and the ships. ")


class ThrottledProxy:
    """A TCP relay in front of Redis whose replies, per connection, stop after
    ``budget`` bytes (Redis stalls mid-reply) or trickle ``chunk`` bytes every
    ``pause_s`` seconds (a slow link): faults a healthy Redis cannot be made to show."""

    def __init__(self, upstream_port: int, budget: int | None = None, chunk: int = 1 << 16,
                 pause_s: float = 0.0, clock: ManualClock | None = None) -> None:
        self.upstream_port, self.budget, self.chunk, self.pause_s = (
            upstream_port, budget, chunk, pause_s)
        self.clock = clock  # given, a pause moves this clock on instead of sleeping
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.sockets: list[socket.socket] = []
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                client = self.listener.accept()[0]
            except OSError:
                continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.budget),
                             daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, budget: int | None) -> None:
        sent = 0
        try:
            while not self.stop.is_set():
                data = source.recv(self.chunk if budget is None else min(self.chunk, 1 << 16))
                if not data:
                    return
                if budget is not None:
                    data = data[: max(0, budget - sent)]
                if data:
                    sink.sendall(data)
                    sent += len(data)
                elif budget is not None:
                    self.stop.wait()  # hold the connection open, send nothing more
                if self.clock is not None:
                    self.clock.advance(self.pause_s)
                else:
                    time.sleep(self.pause_s)
        except OSError:
            return

    def close(self) -> None:
        self.stop.set()
        for sock in (*self.sockets, self.listener):
            sock.close()


@pytest.fixture()
def proxy_factory(redis_server: RedisServer) -> Iterator[type[ThrottledProxy]]:
    made: list[ThrottledProxy] = []

    class Made(ThrottledProxy):
        def __init__(self, **kwargs: float | int | ManualClock | None) -> None:
            super().__init__(redis_server.port, **kwargs)  # type: ignore[arg-type]
            made.append(self)

    yield Made
    for proxy in made:
        proxy.close()


def _run(target: CausalLM, prompt: tuple[int, ...], cache: PrefixCache | None,
         n: int = 12) -> list[RoundEvent]:
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=n, sampling=GREEDY)
    return list(decode(target, None, request, prefix_cache=cache))


def _tokens(events: list[RoundEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _filled(tiny_target: CausalLM, redis_server: RedisServer) -> tuple[str, tuple[int, ...], int]:
    """A namespace whose prompt's blocks are on the real Redis, the prompt, one block's size."""
    namespace = f"long-{uuid.uuid4().hex}"
    store = RedisStore(redis_server.url)
    cache = PrefixCache(store, namespace, block_tokens=BLOCK)
    prompt = tuple(encode_text(tiny_target.tokenizer, PASSAGE * 4))
    _run(tiny_target, prompt, cache, n=1)
    assert store.flush()
    first = store.get_many(cache.block_keys(prompt[:-1])[:1])[0]
    assert first is not None
    return namespace, prompt, len(first)


def test_a_read_that_stalls_part_way_keeps_the_blocks_it_read(
        tiny_target: CausalLM, redis_server: RedisServer,
        proxy_factory: type[ThrottledProxy]) -> None:
    namespace, prompt, block = _filled(tiny_target, redis_server)
    proxy = proxy_factory(budget=int(2.5 * block) + 256)  # 2 whole blocks, then silence
    store = RedisStore(proxy.url, timeout_s=2.0)  # the relay may wait for a core
    cache = PrefixCache(store, namespace, block_tokens=BLOCK)
    expected = _tokens(_run(tiny_target, prompt, None))
    for _ in range(2):  # the circuit stays closed: the second read goes to Redis again
        events = _run(tiny_target, prompt, cache)
        assert events[0].cached_tokens == 2 * BLOCK
        assert _tokens(events) == expected
    assert store.stats.reads_cut == 2 and store.stats.errors == 0
    assert store.stats.partial_hits == 2 and store.stats.fetched_bytes == 4 * block


def test_a_read_slower_than_the_minimum_rate_is_cut_at_a_block(
        tiny_target: CausalLM, redis_server: RedisServer,
        proxy_factory: type[ThrottledProxy]) -> None:
    namespace, prompt, block = _filled(tiny_target, redis_server)
    # the link's slowness is on the store's clock: each chunk relayed moves it 0.25 s on
    # (2 s a block), however fast or busy the machine really is
    clock = ManualClock()
    proxy = proxy_factory(chunk=block // 8, pause_s=0.25, clock=clock)
    store = RedisStore(proxy.url, timeout_s=2.0, min_rate=block / 16, clock=clock)
    cache = PrefixCache(store, namespace, block_tokens=BLOCK)
    keys = cache.block_keys(prompt[:-1])
    assert len(keys) >= 4
    # the budget grows with the bytes: 2 s + 16 s a block covers every block, and the
    # replies the relay sends ahead of the reads (up to five blocks in flight)
    assert all(v is not None for v in store.get_many(keys))
    store.min_rate = 100 * block  # now 2 s + 10 ms a block: cut after a block or two
    events = _run(tiny_target, prompt, cache)
    assert 0 < events[0].cached_tokens < len(keys) * BLOCK
    assert _tokens(events) == _tokens(_run(tiny_target, prompt, None))
    assert store.stats.reads_cut == 1 and store.stats.errors == 0


# -- realistic size --------------------------------------------------------------------

RULES = " ".join(f"Rule {i}: a guest who books room {100 + i} before noon gets breakfast on "
                 f"floor {i % 7} and a late checkout at {1 + i % 11} pm." for i in range(150))


def test_2k_token_prefix_hits_through_redis_while_another_stream_decodes(
        default_target: CausalLM, redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url)  # the default timeout a server uses
    cache = PrefixCache(store, f"busy-{uuid.uuid4().hex}")  # the default 64-token blocks
    tokenizer = default_target.tokenizer
    prompt = tuple(encode_chat(tokenizer, [{"role": "system", "content": RULES},
                                           {"role": "user", "content": "Room 142: breakfast?"}]))
    assert len(prompt) >= 2048
    busy = GenerationRequest(prompt_ids=tuple(encode_chat(tokenizer, [
        {"role": "user", "content": "Count from one to a thousand in words."}])),
        max_new_tokens=4000, sampling=GREEDY)
    engine = Engine(default_target, prefix_cache=cache)
    engine.start()
    try:
        background = engine.submit(busy)
        events = iter(background)
        next(events)  # the other stream is decoding
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=8, sampling=GREEDY)
        first = list(engine.submit(request))
        assert store.flush()
        second = list(engine.submit(request))
        assert not background.cancelled and next(events).token_ids  # still decoding
        background.cancel()
    finally:
        engine.shutdown()
    full_blocks = (len(prompt) - 1) // 64 * 64
    assert first[0].cached_tokens == 0
    assert second[0].cached_tokens == full_blocks
    assert _tokens(second) == _tokens(first)
    assert store.stats.errors == 0 and store.stats.reads_cut == 0
