"""The chart's Grafana dashboard and alert rules against the real thing: a Prometheus
(Debian's ``prometheus``) scraping a real ``specserve serve`` under a little traffic.

What Grafana would do is done here by hand: its template variables are filled from the
label values Prometheus holds, ``$__rate_interval`` is worked out from the time range
and the scrape interval, and each panel's queries run as ``query_range`` over the
traffic. Used by tests/deploy/test_dashboard.py and tests/deploy/dashboard_picture.py.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import yaml

from tests.conftest import RedisServer, free_port, require_program, stop_process
from tests.reliability.support import ServeProcess, serve

CHART = Path(__file__).resolve().parents[2] / "helm" / "specserve"
DASHBOARD = CHART / "files" / "specserve-dashboard.json"
ALERTS = CHART / "files" / "specserve-alerts.yaml"
JOB = "specserve"
SCRAPE_S = 1  # the scrape and rule-evaluation interval (the data source's "scrape interval")
MAX_DATA_POINTS = 1000  # about a panel's width in pixels, what Grafana asks for at most
SERVER_FLAGS = ("--draft", "ngram+cache", "--max-active", "2", "--max-queue", "4",
                "--prefix-block-tokens", "16", "--log-level", "warning")
BACKOFF_S = 0.25  # what a client refused with 429 waits
# a chat the tiny model answers in a loop, so that n-gram lookup drafts (the chat
# template's own system prompt is a shared prefix of more than one cache block)
CHAT = [{"role": "user", "content": "a b a b a b a b a b"}]
# completion prompts: a shared prefix of several cache blocks, then one of a few endings
SYSTEM = ("You are a terse assistant. Answer in one short line, without preamble. "
          "Repeat the pattern you are shown, and nothing else.")
PATTERNS = ("a b a b a b a b a b", "x y z x y z x y z", "one two one two one two")


@dataclass(frozen=True)
class Target:
    """One query of one panel."""

    panel: str
    kind: str  # timeseries, stat
    unit: str
    ref: str
    expr: str
    legend: str
    grid: Mapping[str, int]  # Grafana's gridPos: x, y, w, h on a 24-column grid


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def load_alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def panels(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every panel but the rows, those inside collapsed rows included."""
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out += panel.get("panels", [])
        else:
            out.append(panel)
    return out


def targets(dashboard: Mapping[str, Any]) -> list[Target]:
    return [Target(p["title"], p["type"], p["fieldConfig"]["defaults"].get("unit", ""),
                   t["refId"], t["expr"], t.get("legendFormat", ""), p["gridPos"])
            for p in panels(dashboard) for t in p["targets"]]


def query_variables(dashboard: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(name, series selector, label) of each ``label_values(selector, label)`` variable,
    in the dashboard's order (a later one may use an earlier one)."""
    out = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", text.strip())
            assert match, f"variable {variable['name']}: not a label_values() query: {text}"
            out.append((variable["name"], match[1], match[2]))
    return out


def rate_interval(range_s: float, scrape_s: float = SCRAPE_S) -> tuple[int, int]:
    """Grafana's step (``$__interval``) and ``$__rate_interval`` for a time range: the
    interval is the range over the data points asked for, at least the scrape interval;
    the rate interval is max(interval + scrape interval, 4 x scrape interval). (Grafana
    also rounds a long range's interval to a round number of seconds; over the short
    ranges here it is the scrape interval either way.)"""
    step = max(math.ceil(scrape_s), math.ceil(range_s / MAX_DATA_POINTS))
    return step, int(max(step + scrape_s, 4 * scrape_s))


ALL = ".*"  # the variables' allValue
_REGEX_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|\\]")


def regex_value(values: Sequence[str]) -> str:
    """A multi-value variable as Grafana writes it into a PromQL regex matcher: each value's
    regex characters escaped (twice: once for the regex, once for the string literal),
    several values as an alternation."""
    escaped = [_REGEX_SPECIAL.sub(lambda m: "\\\\" + m[0], v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, variables: Mapping[str, str], rate_s: int) -> str:
    """``expr`` with its variables (``$name`` or ``${name}``) and ``$__rate_interval``
    filled in; any variable left over is an error."""
    out = expr.replace("$__rate_interval", f"{rate_s}s").replace("${__rate_interval}",
                                                                  f"{rate_s}s")
    for name, value in variables.items():
        pattern = r"\$\{" + name + r"\}|\$" + name + r"\b"
        out = re.sub(pattern, value.replace("\\", "\\\\"), out)  # the value as it is
    assert "$" not in out, f"a variable is left in {out}"
    return out


# -- Prometheus ------------------------------------------------------------------------


class PrometheusError(AssertionError):
    pass


@dataclass
class Prometheus:
    """A real Prometheus process and its HTTP API."""

    port: int
    process: subprocess.Popen[bytes] = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, **params: str | float) -> Any:
        """``data`` of an API answer; a PrometheusError with Prometheus's message when it
        refuses (a query that does not parse is a 400 with errorType bad_data)."""
        url = f"{self.url}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise PrometheusError(f"{body.get('errorType')}: {body.get('error')} ({path} "
                                  f"{params.get('query', '')})")
        return body["data"]

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get("/api/v1/query", query=expr, time=at)["result"]
        return result

    def query_range(self, expr: str, start: float, end: float, step: int
                    ) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get("/api/v1/query_range", query=expr,
                                                start=start, end=end, step=step)["result"]
        return result

    def label_values(self, label: str, selector: str, start: float, end: float) -> list[str]:
        values: list[str] = self.get(f"/api/v1/label/{label}/values", **{"match[]": selector},
                                     start=start, end=end)
        return values

    def wait_for(self, expr: str, timeout: float) -> list[dict[str, Any]]:
        """Poll an instant query until it has a result."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                result = self.query(expr, time.time())
            except (OSError, PrometheusError):
                result = []
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.25)


@contextmanager
def prometheus(scrape_target: str, rule_files: Sequence[Path], workdir: Path
               ) -> Iterator[Prometheus]:
    """Prometheus scraping ``host:port`` as job "specserve" every second, evaluating
    ``rule_files`` as often; stopped (and its data dropped with ``workdir``) at the end."""
    binary = require_program("prometheus", "prometheus")
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [scrape_target]}]}],
    }))
    port = free_port()
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        prom = Prometheus(port, process)
        if not prom.wait_for(f'up{{job="{JOB}"}} == 1', timeout=60):
            raise RuntimeError("Prometheus did not scrape the server")
        yield prom
    finally:
        stop_process(process, 20)


# -- traffic ---------------------------------------------------------------------------


@dataclass
class Tally:
    """What the clients sent and got, by kind of answer."""

    counts: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1


def one_request(client: openai.OpenAI, model: str, n: int, max_tokens: int) -> str:
    """The ``n``-th request of a client: chat and completions, streamed and not, with
    the default drafter, the n-gram drafter alone or no speculation, now and then one
    the server refuses (an unknown model, a temperature out of range). Returns what
    came back: ok, or the error's status."""
    pattern = PATTERNS[n % len(PATTERNS)]
    speculation = ({}, {"drafter": "ngram"}, {"enabled": False})[n % 3]
    sampling: dict[str, Any] = ({"temperature": 0} if n % 4 else
                                {"temperature": 0.8, "seed": n})
    extra = {"extra_body": {"speculation": speculation}} if speculation else {}
    try:
        if n % 11 == 10:
            bad_model = n % 2 == 0
            client.chat.completions.create(
                model="no-such-model" if bad_model else model, max_tokens=4,
                temperature=0 if bad_model else 5, messages=CHAT)  # type: ignore[arg-type]
        elif n % 2 == 0:
            stream = n % 4 == 0
            reply = client.chat.completions.create(
                model=model, max_tokens=max_tokens, stream=stream, messages=CHAT,  # type: ignore[arg-type]
                **sampling, **extra)
            if stream:
                for _ in reply:  # type: ignore[union-attr]
                    pass
        else:
            stream = n % 3 == 1
            reply = client.completions.create(model=model, prompt=f"{SYSTEM}\n{pattern}",
                                              max_tokens=max_tokens, stream=stream,
                                              **sampling, **extra)
            if stream:
                for _ in reply:  # type: ignore[union-attr]
                    pass
        return "ok"
    except openai.APIStatusError as exc:
        return str(exc.status_code)


def run_clients(url: str, model: str, clients: int, seconds: float, max_tokens: int,
                tally: Tally) -> None:
    """``clients`` threads sending one request after another for ``seconds``; a client
    refused with 429 waits a little before its next one, as clients back off."""
    deadline = time.monotonic() + seconds

    def loop(first: int) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        n = first
        while time.monotonic() < deadline:
            answer = one_request(client, model, n, max_tokens)
            tally.add(answer)
            n += clients
            if answer == "429":
                time.sleep(BACKOFF_S)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds + 180)


@dataclass(frozen=True)
class Phases:
    """How long each part of the traffic lasts, and how much it asks for."""

    steady_s: float = 14.0  # 3 clients: within the server's bounds
    burst_s: float = 5.0  # 12 clients: the queue fills, some requests get 429
    redis_down_s: float = 4.0  # 3 clients with Redis stopped: cache errors
    max_tokens: int = 48


@dataclass
class Observed:
    """A server that ran the traffic, the Prometheus that scraped it, and the window."""

    server: ServeProcess
    prom: Prometheus
    model: str
    start: float
    end: float
    tally: Tally


@contextmanager
def observed_server(model_dir: Path, workdir: Path, phases: Phases = Phases(),
                    flags: Sequence[str] = SERVER_FLAGS, model: str = "tiny"
                    ) -> Iterator[Observed]:
    """Redis, ``specserve serve`` on it, and Prometheus scraping it with the alert rules
    loaded; then steady traffic, a burst past the queue, and traffic with Redis stopped.
    Yields once the last scrape and rule evaluation after the traffic are in."""
    with ExitStack() as stack:
        redis = RedisServer()
        redis.start()
        stack.callback(redis.stop)
        server = stack.enter_context(serve(model_dir, "--redis-url", redis.url, *flags))
        scrape_target = server.metrics_url.removeprefix("http://")
        prom = stack.enter_context(prometheus(scrape_target, [ALERTS], workdir))
        tally = Tally()
        start = time.time()
        run_clients(server.url, model, 3, phases.steady_s, phases.max_tokens, tally)
        run_clients(server.url, model, 12, phases.burst_s, phases.max_tokens, tally)
        redis.stop()
        run_clients(server.url, model, 3, phases.redis_down_s, phases.max_tokens, tally)
        end = time.time()
        time.sleep(3 * SCRAPE_S)  # a scrape and an evaluation of the final counters
        yield Observed(server, prom, model, start, end, tally)
