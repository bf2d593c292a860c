"""The composition root: ``create_app(settings, engine=None)`` and ``specserve serve``.

With no engine injected, the lifespan loads the target and drafters in the
background (``/health`` answers at once, ``/ready`` turns 200 once they are
loaded and warm) and shuts the engine down on exit. An injected engine belongs
to the caller, who starts and stops it.

``specserve serve`` runs uvicorn with a graceful drain: the first SIGTERM (or
SIGINT) stops admitting (``/ready`` and new requests answer 503), lets in-flight
requests finish for up to ``--shutdown-timeout`` seconds, cancels the rest, and
then exits with status 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from types import FrameType

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from transformers.utils import logging as transformers_logging

from decoding.drafter import Drafter
from decoding.engine import Engine
from decoding.invariance import InvarianceCheck
from decoding.prefix_cache import InProcessStore, PrefixCache, PrefixStore
from decoding.threads import default_decode_threads
from drafters.combined import CombinedDrafter
from drafters.prediction import PredictionDrafter
from gateway.api import pages
from gateway.api.middleware import HeadAsGetMiddleware, RequestMetricsMiddleware
from gateway.api.openapi import install_openapi
from gateway.api.responses import router as responses_router
from gateway.api.routes import router
from gateway.api.tokenize import router as tokenizing_router
from gateway.service.curve_store import set_verify_curve
from gateway.service.redis_store import RedisStore, redacted
from gateway.service.settings import Settings, add_settings_flags, settings_from_args
from gateway.service.startup import CONFIG_ERRORS, StartupError, check_settings, fail, one_line
from gateway.service.state import GatewayState
from gateway.wire.errors import install_error_handlers
from observability.logging import configure_logging
from observability.metrics import start_metrics_server
from observability.telemetry import Telemetry
from observability.tracing import build_tracer_provider
from runtime.files import model_store
from runtime.loaders.loading import load_target, target_precision
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from runtime.runner.memory import MMAP_THRESHOLD_BYTES, map_large_allocations, release_freed_memory
from wiring.drafts import (
    AUTO,
    CACHE,
    NGRAM,
    NO_DRAFT,
    DraftLoader,
    auto_choice,
    load_drafter,
    torch_draft_loader,
)

log = logging.getLogger(__name__)

UVICORN_GRACE_SECONDS = 5.0  # after our own drain, for responses still being written
ENGINE_JOIN_SECONDS = 0.0  # the drain already waited; cancel whatever is left


def kernels_key(target: CausalLM) -> str:
    """What computed the cached KV besides the weights: the two kernel paths round
    differently (a replica reading another's KV would then not continue as plain
    decoding would), and so may two versions of the native sources. The native
    kernels' instruction-set levels compute the same, so replicas on different CPUs
    share their entries."""
    products = getattr(target, "product_activations", "")
    if getattr(target, "kernels", "torch") != "native":
        return "torch" if products != "int8" else "torch-int8"
    from runtime.native.kernels import source_digest

    return f"native-{source_digest()[:16]}" + ("-int8" if products == "int8" else "")


def kernels_name(target: CausalLM) -> str:
    """What /v1/models says computes the target: ``torch``, or ``native-`` and the
    instruction-set level of the kernels loaded (``native-avx2``)."""
    if getattr(target, "kernels", "torch") != "native":
        return "torch"
    from runtime.native.kernels import native

    return f"native-{native().capability()}"


def build_prefix_cache(settings: Settings, target: CausalLM) -> PrefixCache | None:
    """The prompt/continuation cache: on Redis when a URL is set, else in process."""
    if not settings.prefix_cache:
        return None
    store: PrefixStore
    if settings.redis_url:
        store = RedisStore(settings.redis_url, ttl_s=settings.cache_ttl,
                           timeout_s=settings.redis_timeout)
        health = store.check()
        if health.reachable:
            log.info("prefix cache on Redis %s", redacted(settings.redis_url))
        else:  # the cache is optional: serve without it until Redis answers
            log.warning("prefix cache on Redis %s: not reachable at start-up (%s); serving "
                        "without it until it answers (see /ready)",
                        redacted(settings.redis_url), health.error)
    else:
        store = InProcessStore(max_bytes=settings.prefix_cache_bytes, ttl_s=settings.cache_ttl)
    namespace = "|".join([settings.model_name, model_store.revision(target.name),
                          str(target.dtype).removeprefix("torch."), target_precision(target),
                          kernels_key(target)])
    return PrefixCache(store, namespace, block_tokens=settings.prefix_block_tokens)


def build_drafters(settings: Settings, target: CausalLM, cache: PrefixCache | None,
                   draft_loader: DraftLoader = torch_draft_loader, draft: str | None = None,
                   ) -> tuple[dict[str, Drafter], str | None, str]:
    """Every drafter a request may ask for by name, the default one, and the backend
    its draft model runs on (``builtin`` when no model runs). ``draft``: the default's
    spec where the caller has resolved it (else ``settings.draft``)."""
    draft = settings.draft if draft is None else draft
    cheap = [NGRAM, *([CACHE] if cache is not None else [])]
    drafters: dict[str, Drafter] = {}
    for spec in dict.fromkeys([*cheap, "+".join(cheap)]):  # free: no model behind them
        drafter = load_drafter(spec, target, settings.dtype, cache)
        assert drafter is not None
        drafters[drafter.name] = drafter
    if draft == NO_DRAFT:
        return drafters, None, "none"
    default, backend = draft_loader(draft, target, settings.draft_backend,
                                    settings.dtype, cache, draft_dtype=settings.draft_dtype)
    assert default is not None
    drafters.setdefault(default.name, default)
    if isinstance(default, CombinedDrafter) and default.model is not None:
        drafters.setdefault(default.model.name, default.model)  # the draft model alone
    log.info("default drafter %s (draft backend: %s)", default.name, backend)
    return drafters, default.name, backend


def draft_models(drafters: Mapping[str, Drafter]) -> dict[str, CausalLM]:
    """The draft models that run on this host's PyTorch or native runtime, by drafter
    name: their step is measured against the target's (another backend's is not)."""
    models: dict[str, CausalLM] = {}
    for name, drafter in drafters.items():
        model = drafter.model if isinstance(drafter, CombinedDrafter) else drafter
        runner = getattr(model, "model", None)  # a ModelDrafter's draft model
        if isinstance(runner, CausalLM):
            models[name] = runner
    return models


def draft_model_dtype(drafter: Drafter | None) -> str | None:
    """The dtype the drafter's model runs in on PyTorch (None: no model, or another
    backend, whose export says)."""
    model = drafter.model if isinstance(drafter, CombinedDrafter) else drafter
    runner = getattr(model, "model", None)  # a ModelDrafter's draft model
    dtype = getattr(runner, "dtype", None)
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else None


def build_engine(settings: Settings, draft_loader: DraftLoader = torch_draft_loader) -> Engine:
    """Load the target and drafters named in the settings (a draft model through
    ``draft_loader``, which the command line injects), warm them up, start."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    target = load_target(settings.target, settings.dtype, quantize=settings.quantize,
                         kernels=settings.kernels, int8_activations=settings.int8_activations)
    if isinstance(target, BatchedLM):
        target.batch_invariant = settings.batch_invariance
    cache = build_prefix_cache(settings, target)
    draft, auto_reason = settings.draft, None
    if draft == AUTO:  # resolved once: the drafters load it, /v1/models says why
        draft, auto_reason = auto_choice(target, prefix_cache=cache is not None)
        log.info("draft auto: %s (%s)", draft, auto_reason)
    drafters, default, backend = build_drafters(settings, target, cache, draft_loader, draft)
    if isinstance(target, BatchedLM):  # the drafts took what they share of it
        target.release_plain_weights()
    info = {"draft_backend": backend, "weights": target_precision(target),
            "activations": str(target.dtype).removeprefix("torch."),
            "kernels": kernels_name(target),
            "product_activations": getattr(target, "product_activations",
                                           str(target.dtype).removeprefix("torch."))}
    draft_dtype = draft_model_dtype(drafters.get(default or ""))
    if draft_dtype is not None:
        info["draft_dtype"] = draft_dtype
    if auto_reason is not None:
        info["draft_auto"] = auto_reason
    engine = Engine(target, drafters, default, max_queue=settings.max_queue,
                    max_active=settings.max_active, prefix_cache=cache,
                    info=info, prefill_chunk=settings.prefill_chunk,
                    batch_planning=settings.batch_speculation == "adaptive",
                    max_kv_bytes=settings.kv_cache_bytes,
                    decode_threads=settings.decode_threads or default_decode_threads(),
                    predicted=PredictionDrafter.around,
                    invariance_check=(InvarianceCheck(settings.check_invariance)
                                      if settings.check_invariance else None))
    log.info("warming up (%s, drafters %s, default %s)", target.name, sorted(drafters), default)
    engine.warmup()
    origin = set_verify_curve(engine, target, draft_models(drafters), settings)
    profile = engine.speculation_profile
    log.info("verify curve %s (one-token step %.1f ms; %s); ceilings %s",
             engine.scheduler.verify_curve.steps if engine.scheduler.verify_curve else None,
             profile["step_ms"] if profile else 0.0, origin,
             profile["ceiling"] if profile else None)
    release_freed_memory()
    engine.start()
    return engine


def create_app(
    settings: Settings,
    engine: Engine | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
    telemetry: Telemetry | None = None,
    draft_loader: DraftLoader = torch_draft_loader,
) -> FastAPI:
    """The API application. ``on_fatal`` is told when loading the models fails;
    ``telemetry`` (metrics registry, tracer) is built from the settings unless given;
    ``draft_loader`` loads the draft model when no engine is given."""
    if telemetry is None:
        provider = build_tracer_provider(otlp_endpoint=settings.otlp_endpoint)
        telemetry = Telemetry(settings.model_name, tracer_provider=provider,
                              log_prompts=settings.log_prompts)
    state = GatewayState(settings=settings, aliases=settings.model_aliases(),
                         telemetry=telemetry)
    if engine is not None:
        state.attach(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = (None if engine is not None
                  else asyncio.create_task(_load(state, on_fatal, draft_loader)))
        try:
            yield
        finally:
            state.draining = True
            if loader is not None and not loader.done():
                loader.cancel()
            if state.owns_engine and state.engine is not None:
                await asyncio.to_thread(state.engine.shutdown, ENGINE_JOIN_SECONDS)
            await asyncio.to_thread(telemetry.shutdown)  # flush spans

    app = FastAPI(title="specserve", version="0.1.0", lifespan=lifespan)
    app.state.gateway = state
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(responses_router)
    app.include_router(tokenizing_router)
    if settings.playground:
        app.include_router(pages.router)
    install_openapi(app, bearer=bool(settings.api_keys),
                    vocab_size=lambda: state.engine.target.vocab_size if state.engine else None)
    app.add_middleware(HeadAsGetMiddleware)
    app.add_middleware(RequestMetricsMiddleware, metrics=telemetry.metrics)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"], expose_headers=["X-Request-Id"],
        )
    return app


async def _load(state: GatewayState, on_fatal: Callable[[BaseException], None] | None,
                draft_loader: DraftLoader) -> None:
    try:
        engine = await asyncio.to_thread(build_engine, state.settings, draft_loader)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if isinstance(exc, CONFIG_ERRORS):  # a wrong path, package or model: one line
            log.error("loading the models failed: %s", one_line(exc))
            log.debug("loading the models failed", exc_info=True)
        else:
            log.exception("loading the models failed")
        state.load_error = f"{type(exc).__name__}: {exc}"
        if on_fatal is not None:
            on_fatal(exc)
        return
    state.owns_engine = True
    state.attach(engine)
    log.info("ready: serving %s", state.settings.model_name)


# -- running under uvicorn -----------------------------------------------------------------


class DrainingServer(uvicorn.Server):
    """uvicorn, with a graceful drain on the first termination signal."""

    def __init__(self, config: uvicorn.Config, state: GatewayState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is not None or self._loop is None:
            self.should_exit = True
            self.force_exit = self._drain is not None
            return
        log.info("received signal %d: draining for up to %.0f s", sig,
                 self.state.settings.shutdown_timeout)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.state.drain(self.state.settings.shutdown_timeout)
        finally:
            self.should_exit = True

    def fail(self, exc: BaseException) -> None:
        """Exit with status 1 (the models could not be loaded)."""
        self.exit_code = 1
        if self._loop is not None:
            self._loop.call_soon_threadsafe(setattr, self, "should_exit", True)
        else:
            self.should_exit = True


def serve(settings: Settings, draft_loader: DraftLoader = torch_draft_loader) -> int:
    if map_large_allocations():
        log.info("C allocations of %d KiB or more are mapped apart (returned when freed)",
                 MMAP_THRESHOLD_BYTES >> 10)
    server_box: list[DrainingServer] = []
    try:
        app = create_app(settings, on_fatal=lambda exc: server_box[0].fail(exc),
                         draft_loader=draft_loader)
    except (ImportError, RuntimeError, ValueError) as exc:  # e.g. the tracing exporter
        raise StartupError(one_line(exc)) from exc
    state: GatewayState = app.state.gateway
    assert state.telemetry is not None
    try:
        metrics_server = start_metrics_server(state.telemetry.metrics, settings.host,
                                              settings.metrics_port)
    except OSError as exc:
        raise StartupError(f"cannot serve metrics on {settings.host}:"
                           f"{settings.metrics_port}: {exc.strerror or exc}") from exc
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        timeout_graceful_shutdown=int(UVICORN_GRACE_SECONDS), access_log=True,
        log_config=None,  # uvicorn's loggers go through ours (observability.logging)
    )
    server = DrainingServer(config, app.state.gateway)
    server_box.append(server)
    try:
        server.run()
    finally:
        metrics_server.shutdown()
    return server.exit_code


def add_serve_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
                      draft_loader: DraftLoader = torch_draft_loader) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_settings_flags(parser)
    parser.set_defaults(func=lambda args: _cmd_serve(args, draft_loader))


def _cmd_serve(args: argparse.Namespace, draft_loader: DraftLoader) -> int:
    """Configuration errors (settings, paths, a missing package, a port in use) are one
    line on stderr and exit status 2; a model that fails to load exits with 1."""
    try:
        settings = settings_from_args(args)
        check_settings(settings)
    except (ValueError, StartupError) as exc:  # pydantic's ValidationError included
        return fail("specserve serve", exc)
    configure_logging(settings.log_level, json_lines=settings.log_format == "json")
    if settings.log_format == "json":  # nothing but JSON lines: no progress bars
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        transformers_logging.disable_progress_bar()
    try:
        return serve(settings, draft_loader)
    except StartupError as exc:
        return fail("specserve serve", exc)
