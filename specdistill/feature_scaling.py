"""``python -m specdistill.feature_scaling OUT.png NAME=REPORT.json ...``: the scaling
table (markdown, on stdout) and plot of feature heads' reports (``report.json`` of a
``specserve distill --kind feature`` run, or an evaluation of the same shape): training
answer tokens, then teacher-forced acceptance and tau at k = 1..5 on each set."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SETS = ("held_out", "multi_turn", "chat", "grounded")  # (multi_turn where it was measured)


def rows(reports: dict[str, dict[str, Any]]) -> list[str]:
    out = ["| head | train answer tokens | steps | set | teacher-forced | tau k=1..5 |",
           "|---|---:|---:|---|---:|---|"]
    for name, report in reports.items():
        training = report.get("training", {})
        for s in SETS:
            if s not in report["evaluation"]:
                continue
            e = report["evaluation"][s]
            tau = " / ".join(f"{t:.3f}" for t in e["tau"])
            out.append(f"| {name} | {training.get('train_answer_tokens', '-')} | "
                       f"{training.get('steps', '-')} | {s} | {e['teacher_forced']:.3f} | "
                       f"{tau} |")
    return out


def plot(reports: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    sets = [s for s in SETS if any(s in r["evaluation"] for r in reports.values())]
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 4), sharey=True)
    for ax, s in zip(axes, sets, strict=True):
        for name, report in reports.items():
            if s not in report["evaluation"]:
                continue
            tau = report["evaluation"][s]["tau"]
            ax.plot(range(1, len(tau) + 1), tau, marker="o", label=name)
        ax.set_title(s.replace("_", "-"))
        ax.set_xlabel("tokens drafted (k)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tau (tokens per round, teacher-forced chains)")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    reports = {}
    for arg in argv[1:]:
        name, _, file = arg.partition("=")
        reports[name] = json.loads(Path(file).read_text())
    print("\n".join(rows(reports)))
    plot(reports, Path(argv[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
