"""``specserve distill --kind feature``: data, then training, of a feature draft.

Both phases resume in one work directory (``--resume``); the draft directory is
rewritten at every evaluation, so an interrupted run leaves a usable draft behind.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

SETTINGS_NAME = "feature-settings.json"
DEFAULT_TOKENS = 150_000
DEFAULT_MAX_NEW_TOKENS = 160
# settings added after the first runs, with the values those runs had
LATER_SETTINGS = (("data", "layers", ()), ("train", "vocab_coverage", 0.0),
                  ("train", "layers", ()), ("train", "reg_weight", 1.0),
                  ("train", "max_train_tokens", 0), ("train", "init_from", ""))


def run_feature_distill(args: argparse.Namespace, command_line: str, work: Path) -> int:
    import torch
    from tqdm import tqdm

    from runtime.loaders.loading import load_target
    from specdistill.feature_data import (
        DEFAULT_DISK_GB,
        FeatureDataSettings,
        default_layers,
        generate,
    )
    from specdistill.feature_train import FeatureTrainSettings, Progress

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device not in ("auto", "cpu"):
        raise SystemExit("--kind feature runs on a CPU (the served target's own weights)")
    out_dir: Path = args.out.expanduser().resolve()
    target = load_target(args.target, "float32", "cpu", "auto", "auto", True)
    layers = _feature_layers(args.feature_layers, int(target.model.config.num_hidden_layers),
                             default_layers)
    data_settings = FeatureDataSettings(
        seed=args.seed, tokens=args.tokens, max_new_tokens=args.max_new_tokens,
        streams=args.batch_size or FeatureDataSettings.streams, layers=layers,
        disk_gb=args.disk_gb or DEFAULT_DISK_GB)
    train_settings = FeatureTrainSettings(
        steps=args.steps, minutes=args.minutes, lr=args.lr or FeatureTrainSettings.lr,
        batch_tokens=args.batch_tokens or FeatureTrainSettings.batch_tokens,
        vocab_top_k=args.vocab_top or FeatureTrainSettings.vocab_top_k, seed=args.seed,
        vocab_coverage=args.vocab_coverage or 0.0,
        ttt_steps=args.ttt_steps or FeatureTrainSettings.ttt_steps,
        ce_weight=FeatureTrainSettings.ce_weight if args.ce_weight is None else args.ce_weight,
        reg_weight=(FeatureTrainSettings.reg_weight if args.reg_weight is None
                    else args.reg_weight),
        layers=layers if args.feature == "fused" else (), max_train_tokens=args.train_tokens,
        init_from=_init_from(args.init_from))
    _check_work(work, data_settings, train_settings, args.resume, not args.data_only)
    started = time.perf_counter()
    print(f"distill: feature draft data in {work / 'data'} (layers kept: "
          f"{list(layers) or 'final only'}, budget {data_settings.disk_gb:g} GB)",
          file=sys.stderr)
    with tqdm(total=data_settings.tokens, desc="target answers", unit="tok") as bar:
        def progress(have: int, grown: Any) -> None:
            bar.update(min(have, data_settings.tokens) - bar.n)
            if grown is not None and grown.passes % 20 == 0:
                bar.set_postfix({"answer_tok/s": f"{grown.answer_tokens / grown.seconds:.0f}",
                                 "rows": f"{grown.rows / grown.passes:.0f}",
                                 "ms/pass": f"{1000 * grown.pass_seconds / grown.passes:.0f}"},
                                refresh=False)

        data_stats = generate(target, work / "data", data_settings, progress)
    run = data_stats["run"]
    print(f"distill: {data_stats['answer_tokens']} answer tokens on disk "
          f"({data_stats['bytes'] / 1e9:.2f} GB); this run {run['answer_tokens']} at "
          f"{run['answer_tokens_per_second']} answer tokens/s, {run['ms_per_pass']} ms a pass "
          f"of {run['mean_rows_per_pass']} rows ({run['stopped']}; report: "
          f"{work / 'data' / 'feature-data.json'})", file=sys.stderr)
    if args.data_only:
        return 0
    from specdistill.feature_train import train

    rate = data_stats["answer_tokens"] / max(1e-9, data_stats["seconds"])
    summary = {k: v for k, v in data_stats.items() if k not in ("shards", "runs", "run")}
    made_with = {"command": command_line, "target": args.target,
                 "data": {**asdict(data_settings), **summary,
                          "answer_tokens_per_second": round(rate, 1),
                          "answers": "each prompt greedy, and sampled at temperatures 0.2 and "
                                     "0.7 among the 40 most likely tokens, seeded per answer",
                          "prompts": "magpie conversations of 1-3 turns (the target writes "
                                     "the user's messages, temperature 1, top-k 40) and "
                                     "grounded tasks over Python standard-library docstrings "
                                     "and functions and Debian package descriptions; none of "
                                     "specbench's chat and grounded prompts"}}
    with tqdm(total=train_settings.steps, desc="distilling", unit="step") as bar:
        postfix: dict[str, str] = {}

        def train_progress(p: Progress) -> None:
            bar.total = p.steps
            bar.n = p.step
            postfix["loss"] = f"{p.loss:.3f}"
            if p.acceptance is not None:
                postfix["held_out_acc"] = f"{p.acceptance:.3f}"
            bar.set_postfix(postfix, refresh=False)
            bar.refresh()

        report = train(target, work, out_dir, train_settings, made_with, train_progress)
    final = report["evaluation"]
    print(f"draft written to {out_dir} ({time.perf_counter() - started:.0f} s this run): "
          f"{report['training']['steps']} steps, held-out teacher-forced acceptance "
          f"{final['held_out']['teacher_forced']:.3f}, tau(k=4) "
          f"{final['held_out']['tau'][3]:.2f}", file=sys.stderr)
    return 0


def _init_from(spec: str | None) -> str:
    """The feature draft directory ``--init-from`` names (``feature-draft``: the shipped
    one), resolved; empty without it."""
    if not spec:
        return ""
    from runtime.drafts.feature_draft import resolve_feature_draft_dir

    directory = resolve_feature_draft_dir(spec)
    if directory is None:
        raise SystemExit(f"--init-from {spec!r}: not a feature draft directory")
    return str(directory.resolve())


def _feature_layers(spec: str, num_layers: int, auto: Any) -> tuple[int, ...]:
    if spec == "auto":
        return tuple(auto(num_layers))
    if spec == "none":
        return ()
    try:
        layers = tuple(int(x) for x in spec.split(","))
    except ValueError:
        raise SystemExit(f"--feature-layers takes auto, none or layer numbers, not {spec!r}"
                         ) from None
    if any(not 0 <= i < num_layers for i in layers):
        raise SystemExit(f"--feature-layers: the target has layers 0..{num_layers - 1}")
    return layers


def _check_work(work: Path, data: Any, training: Any, resume: bool, trains: bool = True
                ) -> None:
    """A work directory belongs to one set of settings (token and step counts may grow).
    A run that only makes data (``trains`` false) answers for the data's settings alone
    and leaves the recorded training settings as they were."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / SETTINGS_NAME
    fixed = {"data": {k: v for k, v in asdict(data).items()
                      if k not in ("tokens", "streams", "disk_gb")},
             "train": {k: v for k, v in asdict(training).items()
                       if k not in ("steps", "minutes", "eval_every", "shard_window")}}
    for part, key, default in LATER_SETTINGS:  # at their defaults, earlier runs resume
        if fixed[part].get(key) == default:
            del fixed[part][key]
    fixed = json.loads(json.dumps(fixed))
    if path.exists():
        if not resume:
            raise SystemExit(f"{work} holds an earlier run; pass --resume to continue it, or "
                             "--work DIR for a fresh one")
        before = json.loads(path.read_text())
        if not trains and "train" in before:
            fixed["train"] = before["train"]
        if before != fixed:
            raise SystemExit(f"--resume with different settings than the run in {work}: "
                             f"{before} vs {fixed}")
    path.write_text(json.dumps(fixed, indent=2) + "\n")
