"""The prefix/continuation store on Redis, shared by every replica.

Redis is an accelerator, never a dependency. Reads are bounded by progress,
not by one fixed time for the whole payload: the keys go out in pipelined
batches of GETs, the first reply must come within ``timeout_s`` and every
later socket read make progress within ``MID_READ_STALL_S``, and the whole
read may take ``timeout_s`` plus the bytes received at ``min_rate``; a read
past that is cut at a block boundary and the blocks already read are returned
(a cut is counted, not an error). A Redis that is down or sends nothing at
all within ``timeout_s`` is an error and opens a short circuit, so that a
dead or hanging Redis does not cost every request a timeout. Writes go
through a background thread, off the model thread, with a timeout that
allows for their size. The client reconnects by itself.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from decoding.prefix_cache import CacheStats

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 0.2  # no first reply for this long: Redis is down or hung
DEFAULT_TTL_S = 3600
DEFAULT_MIN_RATE = 10e6  # bytes/s a long read must keep up, on a machine short of CPU too
CIRCUIT_OPEN_S = 1.0  # after a failure, skip Redis for this long
KEY_PREFIX = b"specserve:"
BATCH_KEYS = 4  # GETs per pipelined batch (one KV block each)
WINDOW = 2  # batches in flight: Redis builds the next while this one is read
MID_READ_STALL_S = 1.0  # once Redis has answered, a pause this long cuts the read
WRITE_TIMEOUT_S = 2.0  # per socket write in the background writer
MAX_PENDING_BYTES = 1 << 30  # queued writes beyond this are dropped
HEALTH_MAX_AGE_S = 5.0  # /ready pings Redis at most this often


def redacted(url: str) -> str:
    """The URL without its password, for logs and /ready."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))


@dataclass(frozen=True)
class RedisHealth:
    """The last ping's outcome: whether Redis answered, and why not."""

    reachable: bool
    error: str | None  # the failure, e.g. a name that does not resolve
    checked_at: float  # time.monotonic() of the ping


class RedisStore:
    def __init__(
        self,
        url: str,
        ttl_s: int | None = DEFAULT_TTL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        circuit_open_s: float = CIRCUIT_OPEN_S,
        min_rate: float = DEFAULT_MIN_RATE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - redis is a default dependency
            raise RuntimeError("SPECSERVE_REDIS_URL is set but the 'redis' package is missing; "
                               "pip install 'specserve[redis]'") from exc
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._timeout_error: type[BaseException] = redis.TimeoutError
        self._client: Any = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry_on_timeout=False, health_check_interval=0,
        )
        self._writer_client: Any = redis.Redis.from_url(
            url, socket_timeout=max(timeout_s, WRITE_TIMEOUT_S),
            socket_connect_timeout=timeout_s, retry_on_timeout=False, health_check_interval=0,
        )
        self.url = url
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.circuit_open_s = circuit_open_s
        self._clock = clock  # the circuit's and the read budget's time (a test may drive it)
        self.stats = CacheStats()
        self._open_until = 0.0
        self._lock = threading.Lock()
        self._health: RedisHealth | None = None
        self._pending: queue.Queue[list[tuple[bytes, bytes]]] = queue.Queue()
        self._pending_bytes = 0
        self._writer = threading.Thread(target=self._write_loop, name="specserve-redis-writer",
                                        daemon=True)
        self._writer.start()

    # -- reads ---------------------------------------------------------------------

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values in order; after a cut or a failure, those read before it."""
        out: list[bytes | None] = [None] * len(keys)
        if not keys or self._circuit_open():
            return out
        pool = self._client.connection_pool
        try:
            conn = pool.get_connection()
        except self._errors as exc:
            self._failed("get", exc)
            return out
        read, fetched, clean = 0, 0, False
        start = self._clock()
        try:
            for value in self._replies(conn, keys):
                out[read] = value if isinstance(value, bytes) else None
                read += 1
                fetched += len(out[read - 1] or b"")
                if read < len(keys) and (self._clock() - start
                                         > self.timeout_s + fetched / self.min_rate):
                    self._cut(read, len(keys), "too slow")
                    break
            else:
                clean = True
        except self._errors as exc:
            if read and isinstance(exc, self._timeout_error):  # slow mid-read, not dead
                self._cut(read, len(keys), "stalled")
            else:
                self._failed("get", exc)
        finally:
            if not clean:
                conn.disconnect()  # replies may still be on the wire
            pool.release(conn)
        return out

    def _replies(self, conn: Any, keys: Sequence[bytes]) -> Iterator[object]:
        """Each GET's reply in order, keeping ``WINDOW`` batches in flight."""
        # the first batch is one value, so the first reply comes as soon as Redis can
        batches = [keys[:1]] + [keys[i : i + BATCH_KEYS] for i in range(1, len(keys), BATCH_KEYS)]

        def send(batch: Sequence[bytes]) -> None:
            commands = [("GET", KEY_PREFIX + key) for key in batch]
            conn.send_packed_command(conn.pack_commands(commands), check_health=False)

        for batch in batches[:WINDOW]:
            send(batch)
        alive = max(self.timeout_s, MID_READ_STALL_S)
        for index, batch in enumerate(batches):
            for position in range(len(batch)):
                first = index == 0 and position == 0
                yield conn.read_response(disable_decoding=True,
                                         timeout=self.timeout_s if first else alive)
            if index + WINDOW < len(batches):
                send(batches[index + WINDOW])

    def _cut(self, read: int, wanted: int, why: str) -> None:
        self.stats.add(reads_cut=1)
        log.info("redis read cut after %d of %d values (%s); the rest is a miss", read,
                 wanted, why)

    # -- writes --------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Queue the items for the background writer (dropped while the circuit is open
        or when too much is already queued)."""
        if not items or self._circuit_open():
            return
        size = sum(len(k) + len(v) for k, v in items)
        with self._lock:
            if self._pending_bytes + size > MAX_PENDING_BYTES:
                self.stats.add(puts_dropped=1)
                return
            self._pending_bytes += size
        self._pending.put(list(items))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write has been sent (True) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while self._pending.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _write_loop(self) -> None:
        while True:
            items = self._pending.get()
            try:
                if not self._circuit_open():
                    self._write(items)
            finally:
                with self._lock:
                    self._pending_bytes -= sum(len(k) + len(v) for k, v in items)
                self._pending.task_done()

    def _write(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        try:
            for start in range(0, len(items), BATCH_KEYS):
                pipe = self._writer_client.pipeline(transaction=False)
                for key, value in items[start : start + BATCH_KEYS]:
                    pipe.set(KEY_PREFIX + key, value, ex=self.ttl_s)
                pipe.execute()
        except self._errors as exc:
            self._failed("put", exc)

    # -- health --------------------------------------------------------------------

    def check(self) -> RedisHealth:
        """Ping Redis now (bounded by ``timeout_s``) and remember the outcome."""
        error: str | None = None
        try:
            if not self._client.ping():
                error = "PING was not answered with PONG"
        except self._errors as exc:
            error = f"{type(exc).__name__}: {exc}"
        health = RedisHealth(reachable=error is None, error=error, checked_at=time.monotonic())
        with self._lock:
            self._health = health
        return health

    def health(self) -> RedisHealth:
        """The last ping's outcome, pinging again when it is older than HEALTH_MAX_AGE_S."""
        with self._lock:
            last = self._health
        if last is not None and time.monotonic() - last.checked_at < HEALTH_MAX_AGE_S:
            return last
        return self.check()

    def _circuit_open(self) -> bool:
        return self._clock() < self._open_until

    def _failed(self, op: str, exc: BaseException) -> None:
        self.stats.add(errors=1)
        with self._lock:
            self._open_until = self._clock() + self.circuit_open_s
        log.warning("redis %s failed (%s); treating as a miss for %.1fs", op,
                    type(exc).__name__, self.circuit_open_s)
