"""Server configuration: one ``Settings`` object, from ``SPECSERVE_*`` variables
and the flags of ``specserve serve`` (a flag wins over its variable).

List settings (``SPECSERVE_API_KEYS``, ``SPECSERVE_CORS_ORIGINS``) are comma
separated in the environment; a JSON array works too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gateway.decode.params import sampling_problems
from runtime.files import model_store
from runtime.native.kernels import KernelChoice

ENV_PREFIX = "SPECSERVE_"
MIB = 1 << 20
CACHE_DRAFT = "cache"  # the continuation drafter, which reads the prefix cache

CommaList = Annotated[list[str], NoDecode]
LogLevel = Literal["critical", "error", "warning", "info", "debug"]


class Settings(BaseSettings):
    """Everything ``specserve serve`` can be told; validated once at start-up."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, le=65535)
    metrics_port: int = Field(default=9100, ge=0, le=65535)
    target: str = "default"
    draft: str = "auto"
    draft_backend: Literal["auto", "torch", "onnx", "tensorrt"] = "auto"
    dtype: Literal["float32", "bfloat16"] = "float32"
    quantize: Literal["auto", "none", "int8", "int4"] = "auto"
    draft_dtype: Literal["auto", "float32", "bfloat16", "int8", "int4"] = "auto"
    threads: int | None = Field(default=None, ge=1)
    decode_threads: int | None = Field(default=None, ge=1)
    check_invariance: float = Field(default=0.0, ge=0.0, le=1.0)
    batch_invariance: bool = True
    kernels: KernelChoice = "auto"
    int8_activations: bool = True
    # the verify curve: "stored" (the one measured before for this target, CPU and threads,
    # else measured now and stored), "measure" (measured now, replacing the stored one)
    verify_curve: Literal["stored", "measure"] = "stored"
    verify_curve_dir: str | None = None  # where measured curves are kept ($SPECSERVE_HOME/curves)
    api_keys: CommaList = Field(default_factory=list)
    max_queue: int = Field(default=64, ge=1)
    max_active: int = Field(default=16, ge=1)
    prefill_chunk: int = Field(default=512, ge=1)
    kv_cache_bytes: int = Field(default=2 * 1024 * MIB, ge=1)
    batch_speculation: Literal["adaptive", "always"] = "adaptive"
    max_prompt_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)  # the operator's cap on an answer
    request_timeout: float | None = Field(default=600.0, gt=0)
    cors_origins: CommaList = Field(default_factory=list)
    shutdown_timeout: float = Field(default=30.0, ge=0)
    log_level: LogLevel = "info"
    served_model_name: str | None = None
    max_body_bytes: int = Field(default=4 * MIB, ge=1024)
    sse_ping_interval: float = Field(default=15.0, gt=0)
    sse_heartbeat_interval: float = Field(default=10.0, gt=0)
    playground: bool = True  # the page at /playground (and / redirecting to it)
    # what a request that leaves temperature, top_p or top_k unset samples with: "model"
    # (the model's recommended values), "openai" (OpenAI's: 1.0, 1.0, off), or a JSON object
    sampling_defaults: str = "model"
    # -- prefix cache ------------------------------------------------------------------
    prefix_cache: bool = True
    redis_url: str | None = None
    prefix_cache_bytes: int = Field(default=512 * MIB, ge=0)
    cache_ttl: int = Field(default=3600, ge=1)
    prefix_block_tokens: int = Field(default=64, ge=1, le=4096)
    redis_timeout: float = Field(default=0.2, gt=0)
    # -- observability -----------------------------------------------------------------
    otlp_endpoint: str | None = None
    log_format: Literal["json", "text"] = "json"
    log_prompts: bool = False

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _draft_without_cache(self) -> Settings:
        """A draft that names ``cache`` needs the prefix cache (``auto`` leaves the
        continuation drafts out by itself when the cache is off)."""
        parts = [p.strip() for p in self.draft.split("+") if p.strip()]
        if not self.prefix_cache and CACHE_DRAFT in parts:
            raise ValueError(f"the draft {self.draft!r} uses the prefix cache, which is "
                             "disabled; leave 'cache' out of the draft or enable the cache")
        return self

    @field_validator("sampling_defaults")
    @classmethod
    def _sampling_defaults(cls, value: str) -> str:
        if value in SAMPLING_SOURCES:
            return value
        try:
            values = json.loads(value)
        except ValueError:
            values = None
        if not isinstance(values, dict):
            raise ValueError("sampling_defaults is 'model', 'openai' or a JSON object such as "
                             '{"temperature": 0.7, "top_p": 0.95}')
        problems = sampling_problems(values)
        if problems:
            raise ValueError("sampling_defaults: " + "; ".join(problems))
        return json.dumps(values, sort_keys=True)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @property
    def model_name(self) -> str:
        """The name shown in ``/v1/models``: the flag, else derived from the target."""
        return self.served_model_name or derive_model_name(self.target)

    def model_aliases(self) -> frozenset[str]:
        """Every name a request's ``model`` may use for the served target."""
        names = {self.model_name, self.target, derive_model_name(self.target)}
        catalogued = model_store.find(self.target)  # a model of the catalogue: all its names
        if catalogued is not None:
            names |= catalogued.names
        return frozenset(names)


SAMPLING_SOURCES = ("model", "openai")
def derive_model_name(target: str) -> str:
    if target in model_store.DEFAULT_ALIASES:
        return model_store.DEFAULT_MODEL
    path = Path(target).expanduser()
    if path.exists():
        return path.resolve().name
    return target  # a hub id such as "org/model"


# -- command-line flags --------------------------------------------------------------

_FLAGS: tuple[tuple[str, str] | tuple[str, str, dict[str, Any]], ...] = (
    ("--host", "interface to listen on (SPECSERVE_HOST, default 0.0.0.0)"),
    ("--port", "API port (SPECSERVE_PORT, default 8000)"),
    ("--metrics-port", "Prometheus metrics port (SPECSERVE_METRICS_PORT, default 9100)"),
    ("--target", "target model: 'default' or another model of the catalogue (`specserve models "
                 "list`; pulled when missing), a model directory, a GGUF file or a hub id "
                 "(SPECSERVE_TARGET)"),
    ("--draft", "'auto' (for the default target the mix of its drafters measured fastest, else "
                "n-gram lookup; continuations when the prefix cache is on), 'none', 'ngram', "
                "'cache' (continuations), 'default-draft', a draft model sharing the target's "
                "tokenizer (a model of the catalogue, a directory or a GGUF file), or several "
                "joined by '+' (SPECSERVE_DRAFT, default auto)"),
    ("--draft-backend", "where a draft model runs: auto (TensorRT with a GPU, else ONNX Runtime "
                        "when an export exists, else PyTorch) (SPECSERVE_DRAFT_BACKEND, default "
                        "auto)"),
    ("--dtype", "SPECSERVE_DTYPE, default float32"),
    ("--quantize", "target weights: auto (a GGUF file's own quantized weights; for the default "
                   "model its Q4_1 GGUF, bfloat16 activations), none (a model directory as it is "
                   "in --dtype; the default model dequantized), int8/int4 (a model directory "
                   "quantized at load) (SPECSERVE_QUANTIZE, default auto; docs/quantization.md)"),
    ("--draft-dtype", "dtype of a draft model on PyTorch: auto (int4 beside a quantized target; "
                      "bfloat16 beside a float32 target on a CPU with native bfloat16; else "
                      "--dtype); int8/int4 quantize it; output is the same either way "
                      "(SPECSERVE_DRAFT_DTYPE)"),
    ("--threads", "CPU threads for PyTorch (SPECSERVE_THREADS)"),
    ("--decode-threads", "CPU threads of a decoding pass (no prompt in it): default all of "
                         "--threads (SPECSERVE_DECODE_THREADS)"),
    ("--no-batch-invariance", "cheaper attention blocks whose logits depend on the batch in the "
                              "last bits, so greedy speculation equals plain decoding only to "
                              "rounding outside float32's products "
                              "(SPECSERVE_BATCH_INVARIANCE=false)"),
    ("--kernels", "what runs a pass's norms, rotary embedding, attention and activation on a CPU: "
                  "native (fused C++ kernels, built once with g++), torch (PyTorch's ops), auto "
                  "(native where they build) (SPECSERVE_KERNELS; docs/performance.md)"),
    ("--no-int8-activations", "keep bfloat16 activations for 4-bit and Q8_0 matrices; by default "
                              "the native kernels quantize them to int8 per block of 32 as "
                              "llama.cpp does, ~1.6x faster a step "
                              "(SPECSERVE_INT8_ACTIVATIONS=false; docs/quantization.md)"),
    ("--verify-curve", "the target's verify curve and its draft models' steps: stored (those "
                       "measured at an earlier start for this target, draft models, CPU and "
                       "threads, else measured now and stored), measure (measured now, replacing "
                       "the stored ones) (SPECSERVE_VERIFY_CURVE, default stored; "
                       "docs/performance.md)"),
    ("--verify-curve-dir", "where measured verify curves are kept, one JSON file each "
                           "(SPECSERVE_VERIFY_CURVE_DIR, default $SPECSERVE_HOME/curves)"),
    ("--check-invariance", "debugging: on this fraction of rounds, recompute the last verified "
                           "position as a one-token step and count mismatches "
                           "(specserve_invariance_mismatches_total; SPECSERVE_CHECK_INVARIANCE, "
                           "default 0: off)",
                           {"metavar": "RATE"}),
    ("--api-key", "accepted bearer key, repeatable (SPECSERVE_API_KEYS, comma separated); none "
                  "configured = no authentication",
                  {"dest": "api_keys", "action": "append"}),
    ("--max-queue", "requests waiting before 429 (SPECSERVE_MAX_QUEUE)"),
    ("--max-active", "requests decoded at once (SPECSERVE_MAX_ACTIVE)"),
    ("--prefill-chunk", "prompt tokens fed per round, so a long prompt does not stall running "
                        "streams (SPECSERVE_PREFILL_CHUNK, default 512)"),
    ("--kv-cache-bytes", "KV cache budget: requests wait while one more would pass it "
                         "(SPECSERVE_KV_CACHE_BYTES, default 2 GiB)"),
    ("--batch-speculation", "adaptive: draft lengths chosen for the whole batch, speculation "
                            "backing off as it grows; always: every request drafts as if alone "
                            "(SPECSERVE_BATCH_SPECULATION, default adaptive)"),
    ("--max-prompt-tokens", "longest prompt accepted (SPECSERVE_MAX_PROMPT_TOKENS; default: the "
                            "model's context)"),
    ("--max-tokens", "operator's cap on an answer's tokens: an answer that would run longer (the "
                     "request asks for more, or sets no limit) ends there with finish_reason "
                     "length, and the log says so (SPECSERVE_MAX_TOKENS; default none: a request "
                     "without max_tokens may run to the end of the context)"),
    ("--request-timeout", "seconds a request may take, queue included (SPECSERVE_REQUEST_TIMEOUT, "
                          "default 600)"),
    ("--cors-origin", "allowed CORS origin, repeatable (SPECSERVE_CORS_ORIGINS, comma separated); "
                      "CORS is off when none is given",
                      {"dest": "cors_origins", "action": "append"}),
    ("--shutdown-timeout", "seconds in-flight requests may finish after SIGTERM "
                           "(SPECSERVE_SHUTDOWN_TIMEOUT, default 30)"),
    ("--log-level", "critical|error|warning|info|debug (SPECSERVE_LOG_LEVEL)",
                    {"choices": None}),
    ("--served-model-name", "model id shown in /v1/models (SPECSERVE_SERVED_MODEL_NAME; default "
                            "derived from the target)"),
    ("--max-body-bytes", "largest request body accepted (SPECSERVE_MAX_BODY_BYTES, default 4 MiB)"),
    ("--sse-ping-interval", "seconds between SSE keep-alive comments "
                            "(SPECSERVE_SSE_PING_INTERVAL, default 15)"),
    ("--sse-heartbeat-interval", "seconds a stream may go without an event (a queued request, a "
                                 "long prompt being read) before it gets a heartbeat event: an "
                                 "empty chunk, or response.in_progress on /v1/responses; clients "
                                 "such as Codex CLI time out on events, not on the keep-alive "
                                 "comments (SPECSERVE_SSE_HEARTBEAT_INTERVAL, default 10)"),
    ("--sampling-defaults", "what a request that leaves temperature, top_p or top_k unset samples "
                            "with: model (the model's generation_config.json; for the default "
                            "model its model card's temperature 0.2, top_p 0.9), openai (OpenAI's "
                            "1.0 and 1.0), or a JSON object such as '{\"temperature\": 0.7}'; a "
                            "request's own values always win (SPECSERVE_SAMPLING_DEFAULTS, "
                            "default model)",
                            {"metavar": "model|openai|JSON"}),
    ("--playground", "serve the playground page at /playground, / redirecting to it "
                     "(SPECSERVE_PLAYGROUND, default on)",
                     {"action": argparse.BooleanOptionalAction}),
    ("--no-prefix-cache", "disable prompt KV reuse and continuation drafts "
                          "(SPECSERVE_PREFIX_CACHE=false)"),
    ("--redis-url", "share the prefix cache through Redis, e.g. redis://host:6379/0 "
                    "(SPECSERVE_REDIS_URL; default: in-process)"),
    ("--prefix-cache-bytes", "in-process cache bound (SPECSERVE_PREFIX_CACHE_BYTES, 512 MiB)"),
    ("--cache-ttl", "seconds a cache entry lives (SPECSERVE_CACHE_TTL, default 3600)"),
    ("--prefix-block-tokens", "tokens per cached KV block (SPECSERVE_PREFIX_BLOCK_TOKENS, default "
                              "64)"),
    ("--redis-timeout", "seconds without a byte from Redis before it counts as down: a miss, and "
                        "skipped for a second; long reads get more time by their size "
                        "(SPECSERVE_REDIS_TIMEOUT, default 0.2)"),
    ("--otlp-endpoint", "OTLP/HTTP endpoint for traces (SPECSERVE_OTLP_ENDPOINT; the standard "
                        "OTEL_EXPORTER_OTLP_* variables work too)"),
    ("--log-format", "SPECSERVE_LOG_FORMAT, default json"),
    ("--log-prompts", "include prompt text in request logs (SPECSERVE_LOG_PROMPTS)",
                      {"action": "store_const", "const": True}),
)

def _typed(dest: str) -> dict[str, Any]:
    """What a flag's value is, read from its setting: a number's type, a choice's values."""
    annotation = Settings.model_fields[dest].annotation
    kinds = [k for k in get_args(annotation) if k is not type(None)] if isinstance(
        annotation, UnionType) else [annotation]
    if len(kinds) == 1 and kinds[0] in (int, float):
        return {"type": kinds[0]}
    if len(kinds) == 1 and get_origin(kinds[0]) is Literal:
        return {"choices": list(get_args(kinds[0]))}
    return {}


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, typed as the setting is; unset flags leave the variable or
    default in force."""
    for flag, help_text, *more in _FLAGS:
        options = more[0] if more else {}
        if flag.startswith("--no-"):  # turns a setting that is on by default off
            options = {"dest": flag.removeprefix("--no-").replace("-", "_"),
                       "action": "store_const", "const": False}
        dest = options.get("dest", flag.removeprefix("--").replace("-", "_"))
        typed = _typed(dest) if "action" not in options else {}
        parser.add_argument(flag, default=None, help=help_text, **{**typed, **options})


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from the environment, overridden by the flags that were given."""
    given = {name: value for name, value in vars(args).items()
             if name in Settings.model_fields and value is not None}
    return Settings(**given)
