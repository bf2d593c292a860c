"""Every Prometheus metric specserve exports, in one place.

Naming: prefix ``specserve_``, base units with suffixes (``_seconds``),
``_total`` only on counters, no colons, bounded labels (model, endpoint,
status, finish_reason, drafter, phase, position, type, kind, tool_choice).
Speculation is counted, never pre-averaged, so that PromQL derives the rates:

    acceptance rate         = rate(specserve_spec_decode_num_accepted_tokens_total[5m])
                              / (rate(specserve_spec_decode_num_accepted_tokens_total[5m])
                                 + rate(specserve_spec_decode_num_rejected_tokens_total[5m]))
    (accepted over accepted plus rejected, not over drafted: ``rate`` extrapolates each
    series on its own, so two counters' rates need not keep their order, while a/(a+r)
    of two non-negative rates stays a share in [0, 1])
    mean acceptance length  = 1 + rate(specserve_spec_decode_num_accepted_tokens_total[5m])
                                  / rate(specserve_spec_decode_num_drafts_total[5m])
    (the 1 is the recovered or bonus token every verified round adds)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "specserve"
# the accepted-per-position counter's positions (no draft is longer)
POSITION_LABELS = 16
# Request-scale latencies reach minutes on CPUs and long generations.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                   160.0, 320.0, 640.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
                         0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ROUND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
                 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

ERROR_TYPES = (
    "invalid_request",  # 400
    "authentication",  # 401
    "not_found",  # 404
    "payload_too_large",  # 413
    "rate_limited",  # 429
    "client_closed",  # 499: the client left before its response was sent
    "unavailable",  # 503: not ready or shutting down
    "timeout",  # the request ran past its deadline
    "model_error",  # the model failed on this request
    "internal",  # anything else (500)
)


class Metrics:
    """The registry and its metrics; one per server (no module-level state)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry

        def counter(name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, list(labels), registry=r)

        def histogram(name: str, doc: str, labels: Iterable[str], buckets: tuple[float, ...]
                      ) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, list(labels), buckets=buckets, registry=r)

        self.requests = counter("requests", "Finished HTTP requests.", ("endpoint", "status"))
        self.request_errors = counter("request_errors", "Failed requests by error type.",
                                      ("endpoint", "type"))
        self.finished = counter("request_success", "Generations finished, by finish reason.",
                                ("model", "finish_reason"))
        self.e2e_latency = histogram("e2e_request_latency_seconds",
                                     "Time from request arrival to its last byte.",
                                     ("model", "endpoint"), LATENCY_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.",
                              ("model", "endpoint"), LATENCY_BUCKETS)
        self.inter_token = histogram("inter_token_latency_seconds",
                                     "Time per output token after the first "
                                     "(round time divided by the tokens it committed).",
                                     ("model",), TOKEN_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time a request waited before its first round.",
                                    ("model",), LATENCY_BUCKETS)
        self.round_duration = histogram("round_duration_seconds",
                                        "Time of one speculation round, by phase.",
                                        ("model", "drafter", "phase"), ROUND_BUCKETS)
        self.batch_size = histogram("batch_size",
                                    "Sequences in the forward pass of each speculation round "
                                    "(observed once per sequence and round).",
                                    ("model",), BATCH_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.", ("model",))
        self.generation_tokens = counter("generation_tokens", "Tokens generated.", ("model",))
        self.drafts = counter("spec_decode_num_drafts",
                              "Speculation rounds that verified at least one draft token.",
                              ("model", "drafter"))
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                    ("model", "drafter"))
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted by verification.",
                                       ("model", "drafter"))
        self.rejected_tokens = counter("spec_decode_num_rejected_tokens",
                                       "Draft tokens verification turned down (drafted minus "
                                       "accepted).", ("model", "drafter"))
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the draft (0-based).",
                                        ("model", "drafter", "position"))
        self.constrained_requests = counter(
            "constrained_requests", "Requests whose output a grammar constrains, by kind "
            "(json_object, json_schema, tools).", ("model", "kind"))
        self.tool_calls = counter(
            "tool_calls", "Tool calls in answers, by endpoint and tool_choice (auto, "
            "required, named); a request that offers tools and gets text adds 0.",
            ("model", "endpoint", "tool_choice"))
        self.grammar_mask_time = histogram(
            "grammar_mask_seconds", "Time per round on grammar masks and matching.",
            ("model",), ROUND_BUCKETS)
        self.grammar_forced_tokens = counter(
            "grammar_forced_draft_tokens", "Grammar-forced tokens proposed as drafts.",
            ("model",))
        self.grammar_forced_accepted = counter(
            "grammar_forced_accepted_tokens", "Grammar-forced draft tokens accepted.",
            ("model",))
        self.running = Gauge(f"{PREFIX}_num_requests_running", "Requests being decoded.",
                             registry=r)
        self.waiting = Gauge(f"{PREFIX}_num_requests_waiting", "Requests queued.", registry=r)

    def track_engine(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        """Read the engine's occupancy at scrape time."""
        self.running.set_function(lambda: float(running()))
        self.waiting.set_function(lambda: float(waiting()))

    def track_capacity(self, max_waiting: int, max_running: int, kv_limit: int | None,
                       kv_blocks: Callable[[], Mapping[str, int]]) -> None:
        """Export the engine's bounds, and its KV blocks (``kv_blocks()`` read at scrape
        time: ``used``, ``free`` (absent without a bound), ``shared``, ``block_bytes`` and
        ``preemptions`` so far), so that queue and KV use can be read as shares of their
        bounds."""
        r = self.registry
        Gauge(f"{PREFIX}_max_requests_waiting", "Requests allowed to wait (--max-queue); "
              "one more is refused with 429.", registry=r).set(max_waiting)
        Gauge(f"{PREFIX}_max_requests_running", "Requests decoded at once at most "
              "(--max-active).", registry=r).set(max_running)
        if kv_limit is not None:
            Gauge(f"{PREFIX}_kv_cache_limit_bytes", "The KV budget: the pool of KV blocks "
                  "(--kv-cache-bytes).", registry=r).set(kv_limit)
        r.register(_KvCollector(kv_blocks))

    def track_cache(self, counts: Callable[[], Mapping[str, int]], store: str) -> None:
        """Export a prefix cache's counters, ``counts()`` read at scrape time."""
        self.registry.register(_CacheCollector(counts, store))

    def track_cache_bytes(self, size: Callable[[], int]) -> None:
        """Read the in-process prefix cache's size at scrape time."""
        gauge = Gauge(f"{PREFIX}_prefix_cache_bytes", "Bytes the in-process prefix cache "
                      "holds (its bound: --prefix-cache-bytes).", registry=self.registry)
        gauge.set_function(lambda: float(size()))

    def track_invariance(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Export the run-time invariance check's ``checks`` and ``mismatches``."""
        self.registry.register(_InvarianceCollector(counts))

    def record_round(self, model: str, drafter: str, drafted: int, accepted: int,
                     draft_s: float, verify_s: float) -> None:
        if drafted > 0:
            self.drafts.labels(model, drafter).inc()
            self.draft_tokens.labels(model, drafter).inc(drafted)
            self.accepted_tokens.labels(model, drafter).inc(accepted)
            self.rejected_tokens.labels(model, drafter).inc(drafted - accepted)
            for position in range(min(accepted, POSITION_LABELS)):
                self.accepted_per_pos.labels(model, drafter, str(position)).inc()
            self.round_duration.labels(model, drafter, "draft").observe(draft_s)
        self.round_duration.labels(model, drafter, "verify").observe(verify_s)


class _CacheCollector(Collector):
    def __init__(self, counts: Callable[[], Mapping[str, int]], store: str) -> None:
        self.counts = counts
        self.store = store

    def collect(self) -> Iterable[Metric]:
        fields = {
            "prefix_cache_lookups": ("lookups", "Prefix cache lookups (one per request)."),
            "prefix_cache_hits": ("hits", "Lookups that reused at least one cached block."),
            "prefix_cache_hit_tokens": ("hit_tokens", "Prompt tokens whose KV was reused."),
            "prefix_cache_partial_hits": ("partial_hits", "Hits that reused only some of the "
                                          "prompt's full blocks (the rest was prefilled)."),
            "prefix_cache_fetched_bytes": ("fetched_bytes", "Bytes of KV blocks read from "
                                           "the store."),
            "prefix_cache_reads_cut": ("reads_cut", "Store reads cut short at a block boundary "
                                       "because they were too slow (blocks read were used)."),
            "prefix_cache_puts_dropped": ("puts_dropped", "Writes dropped because too much was "
                                          "waiting to be written."),
            "continuation_cache_lookups": ("continuation_lookups",
                                           "Continuation drafter lookups."),
            "continuation_cache_hits": ("continuation_hits",
                                        "Continuation lookups that found tokens."),
            "cache_errors": ("errors", "Cache store failures and rejected values."),
        }
        counts = self.counts()
        for name, (attr, doc) in fields.items():
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["store"])
            family.add_metric([self.store], float(counts[attr]))
            yield family

    def describe(self) -> Iterable[Any]:
        return []


class _InvarianceCollector(Collector):
    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterable[Metric]:
        counts = self.counts()
        for name, attr, doc in (
                ("invariance_checks", "checks", "Rounds whose pass was checked against "
                 "one-token steps (--check-invariance)."),
                ("invariance_mismatches", "mismatches", "Checked rounds whose pass gave "
                 "other logits than a one-token step.")):
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            family.add_metric([], float(counts[attr]))
            yield family

    def describe(self) -> Iterable[Any]:
        return []


class _KvCollector(Collector):
    def __init__(self, blocks: Callable[[], Mapping[str, int]]) -> None:
        self.blocks = blocks

    def collect(self) -> Iterable[Metric]:
        blocks = self.blocks()
        used = GaugeMetricFamily(f"{PREFIX}_kv_cache_used_bytes", "KV the running requests "
                                 "hold (each block once, however many share it).")
        used.add_metric([], float(blocks["used"] * blocks["block_bytes"]))
        yield used
        for name, key, doc in (
                ("kv_blocks_used", "used", "KV blocks the running requests hold."),
                ("kv_blocks_free", "free", "KV blocks no running request holds."),
                ("kv_blocks_shared", "shared", "KV blocks more than one running request "
                 "holds (a common prefix, held once).")):
            if key in blocks:
                family = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
                family.add_metric([], float(blocks[key]))
                yield family
        preempted = CounterMetricFamily(f"{PREFIX}_preemptions", "Running requests "
                                        "preempted when the KV blocks ran out (recomputed "
                                        "later; their clients see a pause).")
        preempted.add_metric([], float(blocks["preemptions"]))
        yield preempted

    def describe(self) -> Iterable[Any]:
        return []


def start_metrics_server(metrics: Metrics, host: str, port: int) -> Any:
    """Serve ``/metrics`` on its own port (a daemon thread); returns the server,
    whose ``shutdown()`` stops it and whose ``server_port`` is the bound port."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server
