"""Fixtures for the draft-engine tests: ONNX exports of the tiny models, made once."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from trt.cli import add_export_command
from trt.export import export_onnx
from trt.sources import DraftSource

pytest.importorskip("onnxruntime", reason="the ONNX extra (pip install 'specserve[onnx]')")


def _run_cli(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="specserve")
    add_export_command(parser.add_subparsers())
    args = parser.parse_args(list(argv))
    return int(args.func(args))


@pytest.fixture(scope="session")
def export_cli() -> Callable[[Sequence[str]], int]:
    """Run ``specserve export-draft ...`` in-process; returns the exit status."""
    return _run_cli


@pytest.fixture(scope="session")
def tiny_draft_export(tmp_path_factory: pytest.TempPathFactory, tiny_draft_dir: Path) -> Path:
    """The tiny draft exported through the command line, float32."""
    out = tmp_path_factory.mktemp("tiny-draft-export") / "onnx"
    assert _run_cli(["export-draft", "--draft", str(tiny_draft_dir), "--out", str(out),
                     "--quiet"]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_target_export(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path) -> Path:
    """The tiny target exported as a draft: a draft that agrees with the target everywhere."""
    out = tmp_path_factory.mktemp("tiny-target-export") / "onnx"
    export_onnx(DraftSource.parse(str(tiny_target_dir)), out)
    return out
