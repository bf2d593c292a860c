"""What the HTTP layer knows about the server's life: the engine once loaded,
readiness, draining, and the requests in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from decoding.engine import Engine, RequestStream
from decoding.prefix_cache import InProcessStore
from gateway.decode.fim import FimTokens, fim_tokens
from gateway.decode.params import (
    Limits,
    SamplingDefaults,
    budget_positions,
    model_stops,
    sampling_defaults,
)
from gateway.encode.token_texts import TokenTexts
from gateway.service.redis_store import RedisStore, redacted
from gateway.service.settings import Settings
from gateway.wire.bodies import PrefixCacheHealth
from gateway.wire.errors import ServiceUnavailableError
from grammars.guidance import GrammarCompiler
from observability.telemetry import Telemetry

log = logging.getLogger(__name__)

DRAIN_POLL_SECONDS = 0.05


@dataclass
class GatewayState:
    settings: Settings
    aliases: frozenset[str] = frozenset()  # names a request's ``model`` may use
    engine: Engine | None = None
    owns_engine: bool = False  # built by the lifespan, so shut down by it
    ready: bool = False
    draining: bool = False
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    texts: TokenTexts | None = None
    telemetry: Telemetry | None = None
    grammars: GrammarCompiler | None = None  # built on the first structured request
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)  # for unset fields
    chat_stops: tuple[str, ...] = ()  # the model's generation_config.json stop_strings
    kv_positions: int | None = None  # one sequence's most positions in the KV budget
    fim: FimTokens | None = None  # the model's fill-in-the-middle tokens, if it has them
    _inflight: int = 0
    _streams: dict[int, RequestStream] = field(default_factory=dict)  # by id()
    _idle: asyncio.Event | None = None

    def grammar_compiler(self, engine: Engine) -> GrammarCompiler:
        """The engine's grammar compiler, built on the first structured request."""
        if self.grammars is None:
            target = engine.target
            eos = getattr(target.tokenizer, "eos_token_id", None)
            self.grammars = GrammarCompiler(target.tokenizer, target.vocab_size, eos,
                                            stop_ids=target.eos_token_ids)
        return self.grammars

    def attach(self, engine: Engine) -> None:
        """The engine is loaded and warm: start serving."""
        self.engine = engine
        self.texts = TokenTexts(engine.target.tokenizer)
        self.sampling = sampling_defaults(self.settings.sampling_defaults, engine.target.name)
        log.info("sampling defaults: %s", self.sampling.metadata())
        self.chat_stops = model_stops(engine.target.name)
        self.kv_positions = budget_positions(engine.scheduler.kv_budget)
        self.fim = fim_tokens(engine.target.tokenizer)
        if self.fim is not None:
            log.info("fill-in-the-middle: the %s format (completions take a suffix)",
                     self.fim.models)
        if self.chat_stops:
            log.info("chat answers end at the model's stop strings: %s", list(self.chat_stops))
        if self.telemetry is not None:
            metrics = self.telemetry.metrics
            metrics.track_engine(lambda: engine.num_running, lambda: engine.num_waiting)
            metrics.track_capacity(engine.max_queue, engine.scheduler.max_active,
                                   engine.scheduler.kv_budget.max_bytes,
                                   engine.kv_counts)
            if engine.prefix_cache is not None:
                kind = "redis" if self.settings.redis_url else "in-process"
                metrics.track_cache(engine.prefix_cache.stats.counts, kind)
                store = engine.prefix_cache.store
                if isinstance(store, InProcessStore):
                    metrics.track_cache_bytes(lambda: store.size_bytes)
            if engine.invariance_check is not None:
                metrics.track_invariance(engine.invariance_check.stats.counts)
        self.ready = True

    @property
    def accepting(self) -> bool:
        return (self.ready and not self.draining and self.engine is not None
                and self.engine.accepting)

    async def prefix_cache_health(self) -> PrefixCacheHealth | None:
        """The prefix cache's store and whether it answers (Redis pinged off the event
        loop, at most every few seconds); None without a cache."""
        cache = self.engine.prefix_cache if self.engine is not None else None
        if cache is None:
            return None
        store = cache.store
        if not isinstance(store, RedisStore):
            return PrefixCacheHealth(store="in-process", reachable=True)
        health = await asyncio.to_thread(store.health)
        return PrefixCacheHealth(store="redis", reachable=health.reachable,
                                 url=redacted(store.url), error=health.error)

    def require_engine(self) -> Engine:
        """The engine, or a 503 saying why there is none to use."""
        if self.draining or (self.engine is not None and not self.engine.accepting):
            raise ServiceUnavailableError("The server is shutting down.", code="shutting_down")
        if self.engine is None or not self.ready:
            if self.load_error is not None:
                raise ServiceUnavailableError("The model failed to load.", code="load_failed")
            raise ServiceUnavailableError("The model is still loading; retry shortly.",
                                          code="not_ready")
        return self.engine

    def limits(self, engine: Engine) -> Limits:
        """What a request may ask of ``engine`` (the one ``require_engine`` gave)."""
        return Limits(
            max_context=engine.target.max_context,
            max_prompt_tokens=self.settings.max_prompt_tokens,
            max_tokens=self.settings.max_tokens,
            timeout_s=self.settings.request_timeout,
            vocab_size=engine.target.vocab_size,
            max_choices=engine.max_queue,
            kv_positions=self.kv_positions,
            sampling=self.sampling,
            chat_stops=self.chat_stops,
        )

    def token_texts(self) -> TokenTexts:
        if self.texts is None:
            raise ServiceUnavailableError("The model is still loading; retry shortly.",
                                          code="not_ready")
        return self.texts

    # -- in-flight requests -------------------------------------------------------------

    def begin(self, streams: list[RequestStream]) -> None:
        """Count a request as in flight until :meth:`end` (its response is done)."""
        self._inflight += 1
        self._streams.update((id(s), s) for s in streams)

    def end(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            stream.cancel()  # a no-op for finished streams; frees the engine's slot otherwise
            self._streams.pop(id(stream), None)
        self._inflight -= 1
        if self._inflight == 0 and self._idle is not None:
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Stop admitting, wait up to ``timeout`` s for in-flight requests, then cancel
        what is left. Returns whether everything finished in time."""
        self.draining = True
        if self.engine is not None:
            self.engine.stop_admitting()
        log.info("draining: %d request(s) in flight, waiting up to %.0f s",
                 self._inflight, timeout)
        finished = await self._wait_idle(timeout)
        if not finished:
            log.warning("drain timeout: cancelling %d request(s)", len(self._streams))
            for stream in list(self._streams.values()):
                stream.cancel()
            await self._wait_idle(timeout=2.0)
        return finished

    async def _wait_idle(self, timeout: float) -> bool:
        if self._inflight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return self._inflight == 0
