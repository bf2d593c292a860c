"""The prefix/continuation store on Redis, shared by every replica.

Redis is an accelerator, never a dependency: every call has a timeout in
milliseconds, and any failure (down, slow, full, dropped connection) makes the
call a miss or a dropped write, bumps ``stats.errors`` and opens a short
circuit so that a dead Redis does not cost every request a timeout. The
client reconnects by itself on the next call after the circuit closes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from decoding.prefix_cache import CacheStats

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 0.05
DEFAULT_TTL_S = 3600
CIRCUIT_OPEN_S = 1.0  # after a failure, skip Redis for this long
KEY_PREFIX = b"specserve:"


class RedisStore:
    def __init__(
        self,
        url: str,
        ttl_s: int | None = DEFAULT_TTL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        circuit_open_s: float = CIRCUIT_OPEN_S,
    ) -> None:
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - redis is a default dependency
            raise RuntimeError("SPECSERVE_REDIS_URL is set but the 'redis' package is missing; "
                               "pip install 'specserve[redis]'") from exc
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._client: Any = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry_on_timeout=False, health_check_interval=0,
        )
        self.url = url
        self.ttl_s = ttl_s
        self.circuit_open_s = circuit_open_s
        self.stats = CacheStats()
        self._open_until = 0.0
        self._lock = threading.Lock()

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys or self._circuit_open():
            return [None] * len(keys)
        try:
            values = self._client.mget([KEY_PREFIX + k for k in keys])
        except self._errors as exc:
            self._failed("get", exc)
            return [None] * len(keys)
        if not isinstance(values, list) or len(values) != len(keys):
            self._failed("get", ValueError("unexpected reply shape"))
            return [None] * len(keys)
        return [v if isinstance(v, bytes) else None for v in values]

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        if not items or self._circuit_open():
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(KEY_PREFIX + key, value, ex=self.ttl_s)
            pipe.execute()
        except self._errors as exc:
            self._failed("put", exc)

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except self._errors:
            return False

    def _circuit_open(self) -> bool:
        return time.monotonic() < self._open_until

    def _failed(self, op: str, exc: BaseException) -> None:
        self.stats.add(errors=1)
        with self._lock:
            self._open_until = time.monotonic() + self.circuit_open_s
        log.warning("redis %s failed (%s); treating as a miss for %.1fs", op,
                    type(exc).__name__, self.circuit_open_s)
