"""A saved feature head's evaluation on a work directory's data, as a training run reports
it at its end (``specdistill.feature_eval.full_evaluation``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from runtime.loaders.loading import load_target
from specdistill.feature_data import load_rows, scan
from specdistill.feature_eval import full_evaluation
from specdistill.feature_scaling import rows as table
from specdistill.feature_train import load_draft


def main(argv: list[str] | None = None) -> int:
    """``python -m specdistill.feature_report --draft DIR --work WORK [--json OUT]``: a
    saved head's evaluation on a work directory's data (its held-out rows, their later
    turns, the chat and grounded answers), as a training run's ``report.json`` holds it
    at the end; prints the table of ``specdistill.feature_scaling``."""
    parser = argparse.ArgumentParser(prog="python -m specdistill.feature_report")
    parser.add_argument("--draft", required=True, help="a feature draft directory")
    parser.add_argument("--work", required=True, help="a feature distillation work directory")
    parser.add_argument("--target", default="default")
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the evaluation here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, "float32")
    draft = load_draft(Path(args.draft), target)
    data_dir = Path(args.work) / "data"
    held = scan(data_dir, bool(draft.layers)).held
    bench = [load_rows(data_dir / f"eval-{name}.pt", bool(draft.layers))
             for name in ("chat", "grounded")]
    report = {"draft": str(args.draft), "work": str(args.work),
              "evaluation": full_evaluation(draft, held, bench, args.max_len)}
    print("\n".join(table({Path(args.draft).name: report})))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
