"""``specserve export-draft``: export a draft model for ONNX Runtime and TensorRT.

There is no trained default draft yet, so ``--draft`` names one: a local model
directory sharing the target's tokenizer, or ``default-truncated:N`` (the
default model cut to its first N layers). Without ``--draft`` the command uses
``$SPECSERVE_DRAFT`` when that names a model. Without ``--out`` the export goes
to the cache (``$SPECSERVE_HOME/exports/``) where ``--draft-backend onnx|auto``
finds it; any other ``--out`` directory can be served with ``--draft DIR``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

from runtime.models.checkpoints import DTYPES
from trt import store
from trt.errors import DraftBackendError
from trt.export import DEFAULT_OPSET, export_onnx
from trt.manifest import Manifest, ManifestError
from trt.sources import DraftSource, DraftSourceError
from trt.tensorrt_build import BuildSettings, require_tensorrt
from trt.tensorrt_drafter import load_tensorrt_engine
from wiring.drafts import NGRAM, NO_DRAFT

log = logging.getLogger(__name__)

DRAFT_ENV = "SPECSERVE_DRAFT"
FORMATS = ("onnx", "tensorrt")
DESCRIPTION = f"""\
Export a draft model's decoding step to ONNX, with the KV cache as explicit
inputs and outputs, check it against PyTorch with ONNX Runtime (bfloat16: with
ONNX's reference evaluator, slowly), and write a manifest. --format tensorrt
also builds (and checks) a TensorRT engine for this GPU next to it.

--draft: a local model directory sharing the target's tokenizer, or
default-truncated:N (the default model's first N layers). Default: ${DRAFT_ENV}.
--out: default is the export cache ($SPECSERVE_HOME/exports/), where
`specserve serve --draft-backend onnx|auto` finds it; an export in any other
directory can be served with --draft DIR."""


def add_export_command(subparsers: Any) -> None:
    """Register ``export-draft`` on the ``specserve`` command's subparsers."""
    p = subparsers.add_parser(
        "export-draft", help="export a draft model to ONNX (and build a TensorRT engine)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default=None,
                   help="draft model directory or 'default-truncated:N' "
                        f"(default: ${DRAFT_ENV} when it names a model)")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default: the export cache, found by the server)")
    p.add_argument("--format", choices=FORMATS, default="onnx",
                   help="'tensorrt' also builds and checks an engine for this GPU")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="precision of the export (and of the TensorRT engine)")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help="ONNX opset version")
    p.add_argument("--force", action="store_true", help="export again even if up to date")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    p.add_argument("-v", "--verbose", action="store_true", help="log each step")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    spec = args.draft or os.environ.get(DRAFT_ENV)
    if not spec or spec in (NO_DRAFT, NGRAM):
        print("export-draft: name a draft model with --draft (a model directory, or "
              "default-truncated:N for the default model's first N layers)", file=sys.stderr)
        return 2
    try:
        out = _export(spec, args)
    except (DraftBackendError, DraftSourceError, FileExistsError, ValueError) as exc:
        print(f"export-draft: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _export(spec: str, args: argparse.Namespace) -> Path:
    source = DraftSource.parse(spec)
    out: Path = args.out or store.cache_dir(source, args.dtype)
    manifest = None if args.force else _current(out, source, args.dtype, args.opset)
    if manifest is not None:
        log.warning("%s already holds a current export of %s; use --force to redo it",
                    out, spec)
    else:
        if args.format == "tensorrt":
            require_tensorrt()  # fail before exporting
        manifest = export_onnx(source, out, args.dtype, args.opset, progress=not args.quiet)
        if manifest.check is not None:
            print(f"checked: {manifest.check.summary}", file=sys.stderr)
    if args.format == "tensorrt":
        require_tensorrt()
        device = torch.device("cuda", torch.cuda.current_device())
        engine = load_tensorrt_engine(out, manifest, device,
                                      BuildSettings(max_positions=manifest.max_positions),
                                      reference=source)
        print(f"TensorRT engine ready ({engine.runtime})", file=sys.stderr)
    return out


def _current(out: Path, source: DraftSource, dtype: str, opset: int) -> Manifest | None:
    try:
        manifest = Manifest.load(out)
    except ManifestError:
        return None
    if manifest.opset != opset or store.mismatch(manifest, source, dtype, out) is not None:
        return None
    return manifest
