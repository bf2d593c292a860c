"""``specserve distill``: make a draft for a target.

Two resumable phases in one work directory: the target answers diverse prompts
(data), then a small draft learns to match its distributions (training). The
draft directory is rewritten at every evaluation, so an interrupted run leaves
a usable draft behind; ``--resume`` continues both phases where they stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shlex
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from runtime.files import model_store
from specdistill import prompts as prompt_source
from specdistill.data import (
    POOLS_NAME,
    DataSettings,
    default_streams,
    generate,
    load_or_make_pools,
)
from specdistill.train import (
    CHECKPOINT_NAME,
    Progress,
    TrainSettings,
    starting_draft,
    train,
)

log = logging.getLogger(__name__)

SETTINGS_NAME = "settings.json"


def add_distill_command(sub: Any) -> None:
    """Register ``distill`` on the ``specserve`` sub-command parser."""
    p = sub.add_parser("distill", help="train a small draft model for a target by distillation")
    p.add_argument("--target", default="default", help="the target model (path or 'default')")
    p.add_argument("--kind", choices=("causal-lm", "feature"), default="causal-lm",
                   help="causal-lm: a small language model of the target's own layers; "
                        "feature: one decoder layer that reads the target's hidden states "
                        "(EAGLE-style, see specdistill/feature.py)")
    p.add_argument("--out", required=True, type=Path, help="the draft directory to write")
    p.add_argument("--layers", type=int, default=TrainSettings.layers,
                   help="decoder layers of the draft (started from the target's)")
    p.add_argument("--from-layers", default=None,
                   help="comma-separated target layers the draft's layers start from "
                        "(default: the first N)")
    p.add_argument("--init-from", default=None,
                   help="start from this draft (a directory, or 'default-draft') instead of the "
                        "target's layers: its layers and head are trained further on this run's "
                        "data (--layers and --vocab-top must match it); feature kind: a "
                        "feature draft directory or 'feature-draft' (the shipped one), whose "
                        "layer and fc start the head")
    p.add_argument("--vocab-top", type=int, default=TrainSettings.vocab_top_k,
                   help="output head over the K most frequent target tokens (0: full vocabulary)")
    p.add_argument("--tokens", type=int, default=DataSettings.tokens,
                   help="target answer tokens to generate as training data")
    p.add_argument("--steps", type=int, default=TrainSettings.steps, help="training steps")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help=f"padded tokens per step (default: {TrainSettings.batch_tokens}; "
                        "feature kind: 2048)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default: {TrainSettings.lr}; feature kind: 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=DataSettings.max_new_tokens,
                   help="longest target answer per prompt")
    p.add_argument("--batch-size", type=int, default=None,
                   help="answers the target generates together (default: 32 on a CPU; on a "
                        "GPU as many as its free memory holds, up to 2048)")
    p.add_argument("--held-out-prompts", type=int, default=DataSettings.held_out_prompts)
    p.add_argument("--questions", type=float, default=DataSettings.questions,
                   help="share of prompts the target first writes itself, as a user would "
                        "ask them (0: template prompts only)")
    p.add_argument("--chat", type=float, default=DataSettings.chat,
                   help="share of prompts that are everyday requests in the phrasings people "
                        "type (\"I'm trying to get better at ...\"), on subjects of their own")
    p.add_argument("--device", default="auto",
                   help="where the target answers and the draft trains: cpu, cuda, cuda:N, "
                        "or auto (a CUDA GPU when there is one)")
    p.add_argument("--work", type=Path, default=None,
                   help="data and checkpoints (default: a folder under the specserve cache)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for PyTorch (default: its own choice; 1 is fastest on a "
                        "busy machine)")
    p.add_argument("--minutes", type=float, default=None,
                   help="feature kind: stop training after this many minutes (the schedule "
                        "then spans them instead of --steps)")
    p.add_argument("--data-only", action="store_true",
                   help="feature kind: stop after the data phase")
    p.add_argument("--feature-layers", default="auto",
                   help="feature kind: target layers whose outputs the data keeps beside the "
                        "final hidden states (float16), for EAGLE-3's fused features: auto "
                        "(2, the middle and the third from last; 2,15,27 of 30), none, or a "
                        "comma-separated list")
    p.add_argument("--vocab-coverage", type=float, default=None,
                   help="feature kind: choose the head's tokens as the fewest of the target's "
                        "most frequent answer tokens that cover this share of the held-out "
                        "answer tokens (e.g. 0.97; default: --vocab-top tokens)")
    p.add_argument("--feature", choices=("fused", "final"), default="fused",
                   help="feature kind: what the head reads of the target: EAGLE-3's fused "
                        "feature of --feature-layers (default, where the data keeps them), or "
                        "its final hidden state")
    p.add_argument("--ttt-steps", type=int, default=None,
                   help="feature kind: drafting steps unrolled in training (default 5)")
    p.add_argument("--ce-weight", type=float, default=None,
                   help="feature kind: weight of the soft-label cross-entropy (default 0.1)")
    p.add_argument("--reg-weight", type=float, default=None,
                   help="feature kind: weight of the feature regression (default 1)")
    p.add_argument("--train-tokens", type=int, default=0,
                   help="feature kind: train on the first shards only, up to this many "
                        "training answer tokens (0: all)")
    p.add_argument("--disk-gb", type=float, default=None,
                   help="feature kind: the data shards' disk budget in GB (default 40); "
                        "generation stops there")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run in the work directory")
    p.set_defaults(func=run_distill)


def run_distill(args: argparse.Namespace) -> int:
    import torch

    if args.kind == "feature":
        from specdistill.feature_cli import run_feature_distill

        out = args.out.expanduser().resolve()
        work = (args.work or default_work_dir(out)).expanduser().resolve()
        return run_feature_distill(args, _command_line(args), work)
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    device = _device(args.device)
    if not 0 <= args.questions < 1:
        raise SystemExit(f"--questions is a share in [0, 1), not {args.questions}")
    if not 0 <= args.chat < 1 or args.questions + args.chat >= 1:
        raise SystemExit(f"--chat is a share in [0, 1) that leaves room for the other kinds "
                         f"with --questions {args.questions}, not {args.chat}")
    if args.batch_size is not None and args.batch_size < 1:
        raise SystemExit(f"--batch-size must be at least 1, not {args.batch_size}")
    target_dir = model_store.resolve(args.target)
    out_dir: Path = args.out.expanduser().resolve()
    data_settings = DataSettings(
        seed=args.seed, tokens=args.tokens, held_out_prompts=args.held_out_prompts,
        batch_size=args.batch_size or default_streams(device, target_dir,
                                                      args.max_new_tokens),
        max_new_tokens=args.max_new_tokens,
        questions=args.questions, chat=args.chat)
    train_settings = TrainSettings(
        layers=args.layers,
        from_layers=tuple(int(i) for i in args.from_layers.split(",")) if args.from_layers
        else None,
        vocab_top_k=args.vocab_top or None, steps=args.steps,
        batch_tokens=args.batch_tokens or TrainSettings.batch_tokens,
        lr=args.lr or TrainSettings.lr, seed=args.seed, init_from=args.init_from)
    start = None
    if args.init_from:  # checked before any work (the data can take hours)
        try:
            _, start = starting_draft(train_settings)
        except (ValueError, FileNotFoundError) as exc:
            raise SystemExit(str(exc)) from None
    work = (args.work or default_work_dir(out_dir)).expanduser().resolve()
    _check_work(work, data_settings, train_settings, args.resume)
    command = _command_line(args)
    target_spec = (args.target if args.target in model_store.DEFAULT_ALIASES
                   else str(Path(target_dir).expanduser().resolve()))  # how loaders find it
    made_with = {"command": command, "target": target_spec, "data": asdict(data_settings),
                 "prompt_sources": "Debian package descriptions (apt-cache dumpavail), Python "
                                   "standard-library docstrings, everyday subjects, and "
                                   "questions the target wrote about those subjects"
                                   + (", and everyday chat requests" if args.chat else ""),
                 "device": device}
    # whether every earlier stage held out by subject (see _held_out_by)
    by_subject = start is None or start.made_with.get("held_out_by") == prompt_source.BY_SUBJECT
    if start is not None:  # where the starting draft came from
        made_with["init_from"] = {"draft": args.init_from,
                                  "made_with": start.made_with.get("command")}
        if not by_subject:
            print(f"distill: {args.init_from} comes from runs that chose their held-out "
                  "subjects by the seed, so it may have trained on this run's held-out "
                  "subjects: the held-out acceptance can overstate what new subjects get",
                  file=sys.stderr)

    print(f"distill: data in {work / 'data'}, on {device}", file=sys.stderr)
    with tqdm(total=data_settings.tokens, desc="target answers", unit="tok") as bar:
        def data_progress(have: int, total: int) -> None:
            bar.update(min(have, total) - bar.n)

        have = generate(target_dir, work / "data", data_settings, data_progress, device)
        bar.update(min(have, data_settings.tokens) - bar.n)
    made_with["held_out_by"] = (_held_out_by(work / "data", data_settings.seed) if by_subject
                                else prompt_source.BY_ORDER)
    with tqdm(total=train_settings.steps, desc="distilling", unit="step") as bar:
        postfix: dict[str, str] = {}

        def train_progress(p: Progress) -> None:
            bar.n = p.step
            postfix["loss"] = f"{p.loss:.3f}"
            if p.acceptance is not None:  # shown until the next evaluation
                postfix["held_out_acc"] = f"{p.acceptance:.3f}"
            bar.set_postfix(postfix, refresh=False)
            bar.refresh()

        results = train(target_dir, work / "data", work, out_dir, train_settings, made_with,
                        train_progress, device)
    last = results["history"][-1] if results["history"] else {}
    print(f"draft written to {out_dir}: {results['steps']} steps, held-out acceptance "
          f"{last.get('acceptance', float('nan')):.3f}, head coverage "
          f"{results['held_out_head_coverage']:.3f}", file=sys.stderr)
    return 0


def _held_out_by(data_dir: Path, seed: int) -> str:
    """How this run's data chose its held-out subjects (``draft.json`` records ``subject``
    only when every earlier stage's did too). Data made by a version that kept no subject
    pools split by order."""
    if not (data_dir / POOLS_NAME).exists():
        return prompt_source.BY_ORDER
    return load_or_make_pools(data_dir, seed).held_out_by


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: no CUDA GPU is available here")
    if name != "cpu" and not name.startswith("cuda"):
        raise SystemExit(f"--device must be cpu, cuda, cuda:N or auto, not {name!r}")
    return name


def _command_line(args: argparse.Namespace) -> str:
    """The command as typed when run from a shell, else rebuilt from the parsed flags."""
    if sys.argv[1:2] == ["distill"]:
        return "specserve distill " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {shlex.quote(str(v))}")
             for k, v in vars(args).items() if k != "func" and v is not None and v is not False]
    return "specserve distill " + " ".join(flags)


def default_work_dir(out_dir: Path) -> Path:
    key = hashlib.sha256(str(out_dir).encode()).hexdigest()[:12]
    return model_store.home() / "distill" / f"{out_dir.name}-{key}"


def _check_work(work: Path, data: DataSettings, training: TrainSettings, resume: bool) -> None:
    """A work directory belongs to one set of settings; refuse to mix runs silently."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / SETTINGS_NAME
    # how many tokens, and how many answers grow at once, may change between runs
    fixed = {"data": {k: v for k, v in asdict(data).items() if k not in ("tokens", "batch_size")},
             "train": {f.name: getattr(training, f.name) for f in fields(training)
                       if f.name not in ("steps", "eval_every")}}
    fixed = json.loads(json.dumps(fixed))  # tuples as lists, as read back
    if path.exists():
        before = json.loads(path.read_text())
        before["data"].setdefault("chat", 0.0)  # runs of versions without chat requests
        if not resume:
            raise SystemExit(f"{work} holds an earlier run; pass --resume to continue it, or "
                             "--work DIR for a fresh one")
        if before != fixed:
            raise SystemExit(f"--resume with different settings than the run in {work}: "
                             f"{before} vs {fixed}")
    elif resume and (work / CHECKPOINT_NAME).exists():
        raise SystemExit(f"{work} has a checkpoint but no {SETTINGS_NAME}")
    path.write_text(json.dumps(fixed, indent=2) + "\n")
