"""PNG plots of the benchmarks' JSON reports, written beside the JSON.

``bench.json`` gets ``bench-tokens.png`` (tokens/s per method and prompt set);
an acceptance report ``-acceptance.png`` (acceptance by draft position, tokens
per round by draft length); a concurrency report ``-concurrency.png``
(aggregate tokens/s and inter-token latency against concurrent streams); a peer
report ``-peer.png`` (tokens/s, TTFT and inter-token latency per server).
matplotlib (the ``plots`` extra) draws them with its Agg backend; without it the
benchmarks write their JSON and say once how to get the plots.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

MISSING = "plots need matplotlib: pip install 'specserve[plots]' (wrote the JSON only)"
DPI = 100
Report = dict[str, Any]


def write_plots(kind: str, report: Report, json_path: Path) -> list[Path]:
    """The plots of a ``kind`` of report (bench, acceptance, concurrency, peer), as PNGs
    named after ``json_path``; none, and one line saying why, without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log.warning("%s", MISSING)
        return []
    written = []
    for suffix, draw in PLOTS[kind]:
        figure = Figure(layout="constrained")
        FigureCanvasAgg(figure)
        if not draw(figure, report):
            continue
        path = json_path.with_name(f"{json_path.stem}-{suffix}.png")
        figure.savefig(path, dpi=DPI)
        written.append(path)
        log.info("wrote %s", path)
    return written


def _group_bars(ax: Axes, groups: Sequence[str], series: Mapping[str, Sequence[float]],
                ylabel: str, errors: Mapping[str, Sequence[float]] | None = None) -> None:
    """Bars of each series side by side in each group, values printed on top."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        yerr = None if errors is None else [[0.0] * len(values), list(errors[name])]  # up only
        bars = ax.bar(xs, values, width, label=name, yerr=yerr, capsize=3)
        ax.bar_label(bars, fmt=_short, fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)


def _short(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.2g}"


def _draft_label(spec: str) -> str:
    """A drafter spec with each model path cut to its folder's name."""
    return "+".join(Path(part).name if "/" in part else part for part in spec.split("+"))


def _subtitle(report: Report) -> str:
    machine = report.get("machine") or {}
    return ", ".join(str(v) for v in (machine.get("cpu"), machine.get("threads") and
                                      f"{machine['threads']} threads") if v)


def bench_tokens(figure: Figure, report: Report) -> bool:
    runs = report["runs"]
    if not runs:
        return False
    dtypes = list(dict.fromkeys(r["dtype"] for r in runs))
    sets = list(dict.fromkeys(r["prompt_set"] for r in runs))
    methods = list(dict.fromkeys(r["method"] for r in runs))
    figure.set_size_inches(4.5 * len(dtypes) + 1.5, 4.2)
    axes = figure.subplots(1, len(dtypes), squeeze=False)[0]
    for ax, dtype in zip(axes, dtypes, strict=True):
        rate = {(r["prompt_set"], r["method"]): r["tokens_per_s"] for r in runs
                if r["dtype"] == dtype}
        _group_bars(ax, sets, {m: [rate.get((s, m), 0.0) for s in sets] for m in methods},
                    "tokens/s (greedy)")
        ax.set_title(dtype)
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.suptitle(f"specserve bench: tokens/s per method\n{_subtitle(report)}", fontsize=10)
    return True


def acceptance_positions(figure: Figure, report: Report) -> bool:
    from matplotlib.ticker import MaxNLocator

    rows = report["rows"]
    if not rows:
        return False
    sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
    several = len({r["dtype"] for r in rows}) > 1
    figure.set_size_inches(4.5 * len(sets) + 2.5, 7)
    axes = figure.subplots(2, len(sets), squeeze=False)
    for column, name in enumerate(sets):
        top, bottom = axes[0][column], axes[1][column]
        mine = [r for r in rows if r["prompt_set"] == name]
        for key in dict.fromkeys((r["draft"], r["dtype"]) for r in mine):
            runs = sorted((r for r in mine if (r["draft"], r["dtype"]) == key),
                          key=lambda r: r["k"])
            label = f"{_draft_label(key[0])} ({key[1]})" if several else _draft_label(key[0])
            rates = runs[-1]["position_rates"]  # the longest draft reaches every position
            top.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
            bottom.plot([r["k"] for r in runs], [r["tokens_per_round"] or 0.0 for r in runs],
                        marker="o", label=label)
        top.set(title=name, xlabel="draft position", ylim=(0, 1.05),
                ylabel="accepted, given the earlier ones were")
        bottom.set(xlabel="draft length k", ylabel="tokens per round")
        for ax in (top, bottom):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.suptitle("specserve acceptance: greedy rounds replayed (no timing)", fontsize=10)
    return True


def concurrency_curves(figure: Figure, report: Report) -> bool:
    runs = report["runs"]
    if not runs:
        return False
    sets = list(dict.fromkeys(r["prompt_set"] for r in runs))
    several = len({r["dtype"] for r in runs}) > 1
    levels = sorted({r["concurrency"] for r in runs})
    figure.set_size_inches(4.5 * len(sets) + 2, 7)
    axes = figure.subplots(2, len(sets), squeeze=False)
    for column, name in enumerate(sets):
        top, bottom = axes[0][column], axes[1][column]
        mine = [r for r in runs if r["prompt_set"] == name]
        for key in dict.fromkeys((r["mode"], r["dtype"]) for r in mine):
            line = sorted((r for r in mine if (r["mode"], r["dtype"]) == key),
                          key=lambda r: r["concurrency"])
            label = f"{key[0]} ({key[1]})" if several else key[0]
            xs = [r["concurrency"] for r in line]
            top.plot(xs, [r["tokens_per_s"] for r in line], marker="o", label=label)
            bottom.plot(xs, [r["itl_ms_mean"] or float("nan") for r in line], marker="o",
                        label=label)
        top.set(title=name, ylabel="aggregate tokens/s")
        bottom.set(xlabel="concurrent streams", ylabel="inter-token latency, ms (mean)")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(n) for n in levels])
            ax.grid(alpha=0.3)
    axes[0][-1].legend(title="speculation", fontsize=8, loc="upper left",
                       bbox_to_anchor=(1.0, 1.0))
    figure.suptitle(f"specserve bench --concurrency\n{_subtitle(report)}", fontsize=10)
    return True


def peer_comparison(figure: Figure, report: Report) -> bool:
    runs = report["runs"]
    if not runs:
        return False
    sets = list(dict.fromkeys(r["prompt_set"] for r in runs))
    servers = list(dict.fromkeys(r["server"] for r in runs))
    figure.set_size_inches(13, 4.2)
    axes = figure.subplots(1, 3)
    by = {(r["prompt_set"], r["server"]): r for r in runs}

    def series(key: str) -> dict[str, list[float]]:
        return {s: [by[(n, s)][key] or 0.0 for n in sets] for s in servers}

    _group_bars(axes[0], sets, series("tokens_per_s"), "tokens/s")
    axes[0].set_title("throughput, one request at a time")
    for ax, metric, title in ((axes[1], "ttft", "time to first token"),
                              (axes[2], "itl", "inter-token latency")):
        median, p90 = series(f"{metric}_ms_median"), series(f"{metric}_ms_p90")
        spread = {s: [hi - lo for hi, lo in zip(p90[s], median[s], strict=True)]
                  for s in servers}
        _group_bars(ax, sets, median, "ms (median; bar to p90)", spread)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    max_tokens = report.get("config", {}).get("max_tokens")
    figure.suptitle(f"peer benchmark: streamed chat completions, greedy, max_tokens "
                    f"{max_tokens}", fontsize=10)
    return True


Draw = Callable[["Figure", Report], bool]
PLOTS: dict[str, tuple[tuple[str, Draw], ...]] = {
    "bench": (("tokens", bench_tokens),),
    "acceptance": (("acceptance", acceptance_positions),),
    "concurrency": (("concurrency", concurrency_curves),),
    "peer": (("peer", peer_comparison),),
}
