"""The Grafana dashboard and the alert rules the chart ships, run against a real
Prometheus scraping a real server under traffic (tests/deploy/dashboard.py): every
query parses, every panel shows data, every rule evaluates, and the alerts the traffic
should raise (a full queue, 429s, a stopped Redis) and only those go pending."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import require_program
from tests.deploy.dashboard import (
    ALERTS,
    ALL,
    JOB,
    Observed,
    PrometheusError,
    load_alerts,
    load_dashboard,
    observed_server,
    panels,
    query_variables,
    rate_interval,
    regex_value,
    substitute,
    targets,
)

UNIT_TESTS = Path(__file__).with_name("alerts-test.yaml")
# what the traffic does to the server: its queue fills, requests get 429, Redis stops
EXPECTED_ALERTS = {"SpecserveQueueNearlyFull", "SpecserveRequestsRefused",
                   "SpecservePrefixCacheRedisErrors"}


# ---------------------------------------------------------------------------- offline


def test_promtool_checks_the_rules() -> None:
    promtool = require_program("promtool", "prometheus")
    result = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(load_alerts())} rules found" in result.stdout


def test_promtool_unit_tests_of_the_alerts(tmp_path: Path) -> None:
    """Each alert waits out its ``for:``, fires past its threshold, stays quiet short of
    it, and carries the labels it groups by (alerts-test.yaml). The rules run without
    their annotations, whose text promtool would compare word for word."""
    promtool = require_program("promtool", "prometheus")
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            del rule["annotations"]
    (tmp_path / ALERTS.name).write_text(yaml.safe_dump(rules))
    tests = tmp_path / UNIT_TESTS.name
    shutil.copy(UNIT_TESTS, tests)
    result = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", UNIT_TESTS.read_text()))
    assert tested == {r["alert"] for r in load_alerts()}


def test_the_acceptance_panel_stays_a_share_on_torn_scrapes(tmp_path: Path) -> None:
    """A scrape may read a round's draft count before its accepted count (the model thread
    adds them while the scrape reads), and ``rate`` extrapolates each series on its own:
    accepted over drafted then reads above 1. The panel divides accepted by accepted plus
    rejected, two non-negative rates, which stays a share. Two drafters, evaluated by
    promtool: one accepts every token, one half, each with the 2 m scrape torn (its
    accepted and rejected counts one round behind its draft count)."""
    promtool = require_program("promtool", "prometheus")
    by_title = {(t.panel, t.ref): t for t in targets(load_dashboard())}
    expr = substitute(by_title[("Acceptance rate by drafter", "A")].expr,
                      {"job": JOB, "model": "m"}, 180)
    assert "rejected" in expr
    drafted_form = " / ".join(
        f'sum by (drafter) (rate(specserve_spec_decode_num_{kind}_tokens_total'
        f'{{job=~"{JOB}", model=~"m"}}[180s]))' for kind in ("accepted", "draft"))
    series = {  # one sample a minute from 0 m; the 2 m scrape is torn
        ("all", "draft"): "0 10 20 30 40", ("all", "accepted"): "0 10 10 30 40",
        ("all", "rejected"): "0 0 0 0 0",
        ("half", "draft"): "0 10 20 30 40", ("half", "accepted"): "0 5 5 15 20",
        ("half", "rejected"): "0 5 5 15 20"}
    unit = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": f'specserve_spec_decode_num_{kind}_tokens_total'
                       f'{{job="{JOB}",model="m",drafter="{drafter}"}}', "values": values}
            for (drafter, kind), values in series.items()],
        # the window (1.5 m, 4.5 m] starts at the torn scrape, where accepted over drafted
        # reads 30/20 and 15/20 (the second check: these series do show the fault)
        "promql_expr_test": [
            {"expr": expr, "eval_time": "4m30s", "exp_samples": [
                {"labels": '{drafter="all"}', "value": 1.0},
                {"labels": '{drafter="half"}', "value": 0.5}]},
            {"expr": drafted_form, "eval_time": "4m30s", "exp_samples": [
                {"labels": '{drafter="all"}', "value": 1.5},
                {"labels": '{drafter="half"}', "value": 0.75}]}]}]}
    tests = tmp_path / "panel-test.yaml"
    tests.write_text(yaml.safe_dump(unit))
    result = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_rule_has_a_wait_a_severity_and_words() -> None:
    for rule in load_alerts():
        assert re.fullmatch(r"Specserve[A-Za-z]+", rule["alert"]), rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description"}, rule["alert"]


def test_the_dashboard_is_well_formed() -> None:
    """What Grafana would refuse or mis-draw: every panel on the data source variable,
    unique ids and refIds, panels inside the 24-column grid and not overlapping."""
    dashboard = load_dashboard()
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names[0] == "datasource" and {"job", "model"} <= set(names)
    assert dashboard["templating"]["list"][0] == {**dashboard["templating"]["list"][0],
                                                  "type": "datasource", "query": "prometheus"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {(grid["x"] + dx, grid["y"] + dy)
                for dx in range(grid["w"]) for dy in range(grid["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert all(t["datasource"] == panel["datasource"] for t in panel["targets"])
    for variable in dashboard["templating"]["list"][1:]:
        assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert variable["includeAll"] and variable["allValue"] == ALL


def test_the_dashboard_covers_what_an_operator_reads() -> None:
    titles = {p["title"] for p in panels(load_dashboard())}
    for title in ("Request rate", "Time to first token", "Inter-token latency", "Tokens/s",
                  "Running and waiting", "KV cache and queue use", "Acceptance rate by drafter",
                  "Mean acceptance length", "Tokens per round by drafter", "Rounds that draft"):
        assert title in titles


@pytest.mark.parametrize("values, expected", [
    (["tiny"], "tiny"), (["a.b", "c"], r"(a\\.b|c)"), (["x(1)"], r"x\\(1\\)")])
def test_variables_are_written_as_grafana_writes_them(values: list[str],
                                                      expected: str) -> None:
    assert regex_value(values) == expected
    assert substitute('rate(m{model=~"$model"}[$__rate_interval])', {"model": expected}, 4) \
        == f'rate(m{{model=~"{expected}"}}[4s])'
    with pytest.raises(AssertionError):
        substitute("m{a=~\"$unknown\"}", {"model": "x"}, 4)


def test_rate_interval_follows_grafana() -> None:
    assert rate_interval(60, scrape_s=1) == (1, 4)
    assert rate_interval(6 * 3600, scrape_s=15) == (22, 60)
    assert rate_interval(3600, scrape_s=30) == (30, 120)


# ---------------------------------------------------------------------------- live


@pytest.fixture(scope="module")
def observed(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Observed]:
    with observed_server(tiny_target_dir, tmp_path_factory.mktemp("prometheus")) as run:
        yield run


def _variables(run: Observed, pick_all: bool) -> dict[str, str]:
    """Each template variable as Grafana fills it: its values from Prometheus, then
    either every value (All) or the values it found."""
    chosen: dict[str, str] = {}
    for name, selector, label in query_variables(load_dashboard()):
        found = run.prom.label_values(label, substitute(selector, chosen, 1), run.start,
                                      run.end)
        assert found, f"variable {name}: Prometheus has no {label} on {selector}"
        chosen[name] = ALL if pick_all else regex_value(found)
    return chosen


def _finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(v)) for series in result for _, v in series["values"])


def test_the_traffic_reached_the_server(observed: Observed) -> None:
    counts = observed.tally.counts
    assert counts.get("ok", 0) > 20 and counts.get("429", 0) > 0, counts
    assert counts.get("404", 0) > 0 and counts.get("400", 0) > 0, counts
    assert set(counts) <= {"ok", "400", "404", "429"}, counts
    observed.server.assert_clean_log()


def test_the_variables_find_the_job_and_the_model(observed: Observed) -> None:
    assert _variables(observed, pick_all=False) == {"job": JOB, "model": observed.model}


@pytest.mark.parametrize("pick_all", [False, True], ids=["chosen", "all"])
def test_every_panel_shows_data(observed: Observed, pick_all: bool) -> None:
    """Each query of each panel, as Grafana sends it over the traffic's time range,
    returns series with values; and as an instant query it parses and has a result."""
    variables = _variables(observed, pick_all)
    step, rate_s = rate_interval(observed.end - observed.start)
    empty = []
    for target in targets(load_dashboard()):
        expr = substitute(target.expr, variables, rate_s)
        series = observed.prom.query_range(expr, observed.start, observed.end, step)
        instant = observed.prom.query(expr, observed.end)
        if not _finite(series) or not instant:
            empty.append(f"{target.panel} {target.ref}: {expr}")
    assert empty == []


def test_speculation_and_kv_panels_read_what_the_server_did(observed: Observed) -> None:
    """Values, not only presence: acceptance is a share, some rounds drafted and some
    did not, the KV blocks the running requests held were seen above zero, the queue full."""
    step, rate_s = rate_interval(observed.end - observed.start)
    variables = {"job": JOB, "model": observed.model}
    by_title = {(t.panel, t.ref): t for t in targets(load_dashboard())}

    def values(panel: str, ref: str = "A") -> dict[str, list[float]]:
        expr = substitute(by_title[(panel, ref)].expr, variables, rate_s)
        out = {}
        for series in observed.prom.query_range(expr, observed.start, observed.end, step):
            points = [float(v) for _, v in series["values"] if math.isfinite(float(v))]
            out[json_key(series["metric"])] = points
        return out

    acceptance = values("Acceptance rate by drafter")
    assert {"drafter=ngram", "drafter=ngram+cache"} <= set(acceptance)
    assert all(0 <= v <= 1 for points in acceptance.values() for v in points)
    assert max(v for points in acceptance.values() for v in points) > 0
    per_round = values("Tokens per round by drafter")
    assert min(per_round["drafter=none"]) == max(per_round["drafter=none"]) == 1
    assert max(per_round["drafter=ngram+cache"]) > 1
    drafting = values("Rounds that draft")
    assert max(drafting["drafter=none"]) == 0 and max(drafting["drafter=ngram"]) > 0
    length = values("Mean acceptance length")
    assert all(v >= 1 for points in length.values() for v in points)
    use = values("KV cache and queue use")
    (kv,) = use.values()
    assert 0 < max(kv) <= 1
    (queue,) = values("KV cache and queue use", "B").values()
    assert max(queue) == 1  # the burst filled the queue
    (used,) = values("KV blocks").values()
    (free,) = values("KV blocks", "B").values()
    assert max(used) > 0 and min(used) >= 0 and min(free) > 0  # held while requests ran
    (preempted,) = values("Preemptions").values()
    assert min(preempted) >= 0


def json_key(metric: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(metric.items())) or "{}"


def test_every_rule_evaluates_on_the_live_data(observed: Observed) -> None:
    """Each rule's expression parses as an instant query; Prometheus loaded every rule,
    evaluated it without error, and every metric the rules name exists."""
    names = set(observed.prom.get("/api/v1/label/__name__/values"))
    for rule in load_alerts():
        try:
            observed.prom.query(rule["expr"], observed.end)
        except PrometheusError as exc:
            pytest.fail(f"{rule['alert']}: {exc}")
        used = set(re.findall(r"\bspecserve_[a-z0-9_]+", rule["expr"]))
        assert used <= names, f"{rule['alert']} names metrics the server lacks: {used - names}"
    groups = observed.prom.get("/api/v1/rules")["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(loaded) == {r["alert"] for r in load_alerts()}
    for name, rule in loaded.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))
        assert not rule["lastEvaluation"].startswith("0001"), f"{name} never evaluated"


def test_the_traffic_raises_exactly_the_alerts_it_should(observed: Observed) -> None:
    """Prometheus records every pending or firing alert as an ALERTS series: over the
    traffic, the full queue, the 429s and the stopped Redis raised theirs, nothing else."""
    window = math.ceil(observed.end - observed.start) + 5
    raised = observed.prom.query(f"max by (alertname, severity, job) "
                                 f"(max_over_time(ALERTS[{window}s]))", observed.end + 3)
    assert {s["metric"]["alertname"] for s in raised} == EXPECTED_ALERTS
    assert all(s["metric"]["job"] == JOB for s in raised)
    severities = {r["alert"]: r["labels"]["severity"] for r in load_alerts()}
    assert all(s["metric"]["severity"] == severities[s["metric"]["alertname"]] for s in raised)
    # the Redis errors are inside the rule's 5 minutes still: its alert is pending now,
    # with its annotations written out
    alerts = observed.prom.get("/api/v1/alerts")["alerts"]
    (redis,) = [a for a in alerts if a["labels"]["alertname"] == "SpecservePrefixCacheRedisErrors"]
    assert redis["state"] == "pending"
    instance = redis["labels"]["instance"]
    assert observed.server.metrics_url.endswith(instance)
    assert redis["annotations"]["summary"].startswith(f"specserve {instance}: the Redis")
    assert " errors in 5 minutes" in redis["annotations"]["summary"]
    assert all("error expanding" not in text for text in redis["annotations"].values())
    assert redis["annotations"]["description"].startswith(f"{instance} has counted Redis")
