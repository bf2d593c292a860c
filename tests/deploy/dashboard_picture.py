"""A picture of the Grafana dashboard without Grafana (no registry this project uses
ships a Grafana binary): the default model served under the dashboard test's traffic
(tests/deploy/dashboard.py), each panel's queries run over it as Grafana would run them,
and the series drawn with matplotlib where the dashboard puts each panel.

    python -m tests.deploy.dashboard_picture docs/img/dashboard.png   (make dashboard-picture)
"""

from __future__ import annotations

import argparse
import math
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.dates import DateFormatter
from matplotlib.figure import Figure

from tests.deploy.dashboard import (
    JOB,
    Observed,
    Phases,
    Target,
    load_dashboard,
    observed_server,
    rate_interval,
    regex_value,
    substitute,
    targets,
)

KV_BUDGET = 32 << 20  # a KV budget of which two running requests fill a visible share
UNIT_W, UNIT_H = 0.75, 0.42  # inches per grid column and per grid row
BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
COLORS = ("#73bf69", "#f2cc0c", "#5794f2", "#ff780a", "#b877d9", "#f2495c", "#96d98d",
          "#8ab8ff")
Series = list[tuple[str, list[datetime], list[float]]]


def fetch(run: Observed, model: str, scrape_s: float) -> dict[tuple[str, str], Series]:
    """Each panel query's series over the traffic, (legend, times, values), as Grafana
    draws them with its data source's scrape interval set to ``scrape_s``."""
    step, rate_s = rate_interval(run.end - run.start, scrape_s)
    variables = {"job": regex_value([JOB]), "model": regex_value([model])}
    out: dict[tuple[str, str], Series] = {}
    for target in targets(load_dashboard()):
        expr = substitute(target.expr, variables, rate_s)
        result = run.prom.query_range(expr, run.start, run.end, step)
        out[(target.panel, target.ref)] = [
            (legend(target.legend, s["metric"]),
             [datetime.fromtimestamp(float(t)) for t, _ in s["values"]],
             [float(v) for _, v in s["values"]]) for s in result]
    return out


def legend(template: str, labels: Mapping[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), template) or "value"


def formatted(value: float, unit: str) -> str:
    if not math.isfinite(value):
        return "-"
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
    if unit == "reqps":
        return f"{value:.2f} req/s"
    return f"{value:.3g}"


def _scale(unit: str) -> tuple[float, str]:
    return {"percentunit": (100.0, "%"), "s": (1000.0, "ms"), "reqps": (1.0, "req/s")}.get(
        unit, (1.0, ""))


def draw_timeseries(ax: Axes, target_list: Sequence[Target],
                    data: Mapping[tuple[str, str], Series]) -> None:
    factor, label = _scale(target_list[0].unit)
    lines = [line for t in target_list for line in data[(t.panel, t.ref)]]
    for i, (name, times, values) in enumerate(lines):
        ax.plot(times, [v * factor for v in values], color=COLORS[i % len(COLORS)],
                linewidth=1.1, label=name)
    ax.set_ylabel(label, color=TEXT, fontsize=7)
    ax.xaxis.set_major_formatter(DateFormatter("%H:%M:%S"))
    ax.grid(color=GRID, linewidth=0.5)
    ax.tick_params(colors=TEXT, labelsize=6)
    if lines:
        ax.legend(fontsize=6, loc="upper left", ncols=min(3, len(lines)), frameon=False,
                  labelcolor=TEXT)


def draw_stat(ax: Axes, target: Target, data: Mapping[tuple[str, str], Series]) -> None:
    series = data[(target.panel, target.ref)]
    values = [v for _, _, vs in series for v in vs if math.isfinite(v)]
    last = values[-1] if values else math.nan
    if series:
        times, points = series[0][1], series[0][2]
        ax.fill_between(times, points, color="#73bf69", alpha=0.25, linewidth=0)
    ax.text(0.5, 0.45, formatted(last, target.unit), transform=ax.transAxes, ha="center",
            va="center", fontsize=18, color="#73bf69", weight="bold")
    ax.set_xticks([])
    ax.set_yticks([])


def draw(dashboard: Mapping[str, Any], data: Mapping[tuple[str, str], Series],
         subtitle: str, out: Path) -> None:
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    figure = Figure(figsize=(24 * UNIT_W, (bottom + 2) * UNIT_H), facecolor=BACKGROUND)
    FigureCanvasAgg(figure)
    height = bottom + 2
    figure.text(0.01, 1 - 0.8 / height, f"{dashboard['title']}  ·  {subtitle}", color=TEXT,
                fontsize=11, va="center", linespacing=1.5)
    by_panel: dict[str, list[Target]] = {}
    for target in targets(dashboard):
        by_panel.setdefault(target.panel, []).append(target)
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        top = 1 - (grid["y"] + 2) / height
        if panel["type"] == "row":
            figure.text(0.01, top - 0.5 / height, panel["title"], color=TEXT, fontsize=11,
                        weight="bold", va="center")
            continue
        # room on the left for the tick labels, above for the title, below for the times
        pad_left, pad_right, pad_top, pad_bottom = 0.024, 0.006, 0.9 / height, 0.55 / height
        if panel["type"] == "stat":
            pad_left = pad_right
        ax = figure.add_axes((grid["x"] / 24 + pad_left, top - grid["h"] / height + pad_bottom,
                              grid["w"] / 24 - pad_left - pad_right,
                              grid["h"] / height - pad_top - pad_bottom), facecolor=PANEL)
        for spine in ax.spines.values():
            spine.set_color(GRID)
        ax.set_title(panel["title"], color=TEXT, fontsize=8, loc="left")
        if panel["type"] == "stat":
            draw_stat(ax, by_panel[panel["title"]][0], data)
        else:
            draw_timeseries(ax, by_panel[panel["title"]], data)
            factor, _ = _scale(by_panel[panel["title"]][0].unit)
            defaults = panel["fieldConfig"]["defaults"]  # the axis bounds Grafana keeps
            if "min" in defaults:
                ax.set_ylim(bottom=defaults["min"] * factor)
            if "max" in defaults:
                ax.set_ylim(top=defaults["max"] * factor * 1.05)
    figure.savefig(out, dpi=100, facecolor=BACKGROUND)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steady", type=float, default=90.0, help="seconds of steady traffic")
    parser.add_argument("--burst", type=float, default=15.0, help="seconds of the burst")
    parser.add_argument("--redis-down", type=float, default=15.0,
                        help="seconds of traffic with Redis stopped")
    parser.add_argument("--threads", type=int, default=2, help="the server's CPU threads")
    parser.add_argument("--scrape-interval", type=float, default=5.0,
                        help="the data source's scrape interval Grafana would assume: sets "
                        "the step and $__rate_interval (4x it) of the drawn queries")
    args = parser.parse_args(argv)
    model = "SmolLM2-135M-Instruct"
    flags = ("--draft", "auto", "--max-active", "2", "--max-queue", "4",
             "--prefix-block-tokens", "16", "--log-level", "warning",
             "--threads", str(args.threads), "--served-model-name", model,
             "--kv-cache-bytes", str(KV_BUDGET))
    phases = Phases(steady_s=args.steady, burst_s=args.burst, redis_down_s=args.redis_down,
                    max_tokens=64)
    with tempfile.TemporaryDirectory() as work, \
            observed_server(Path("default"), Path(work), phases, flags, model) as run:
        data = fetch(run, model, args.scrape_interval)
        took = time.strftime("%H:%M:%S", time.localtime(run.start))
    step, rate_s = rate_interval(run.end - run.start, args.scrape_interval)
    subtitle = (f"{model}, drafter auto, {args.threads} threads, 2 running and 4 waiting "
                f"at most, KV budget {KV_BUDGET >> 20} MiB; from {took}: "
                f"{args.steady:.0f} s steady traffic, {args.burst:.0f} s burst past the queue, "
                f"{args.redis_down:.0f} s with Redis stopped\nno Grafana: Prometheus "
                f"query_range results (step {step} s, $__rate_interval {rate_s} s) drawn "
                f"with matplotlib")
    draw(load_dashboard(), data, subtitle, args.out)
    print(f"wrote {args.out}; requests: {run.tally.counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
