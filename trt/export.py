"""Export a draft's decoding step to ONNX, check it, and write its manifest.

The ONNX graph takes ``input_ids [1, seq]`` and ``past_key_i`` / ``past_value_i``
``[1, kv_heads, past, head_dim]`` and returns ``logits [1, vocab]`` (after the
last token) and ``present_key_i`` / ``present_value_i`` ``[1, kv_heads, past +
seq, head_dim]``; ``seq`` and ``past`` are dynamic (``past`` may be 0). An
export is declared good only after ONNX Runtime (for bfloat16, which it cannot
run: ONNX's reference evaluator) reproduces PyTorch's logits on several past/new
lengths (see ``step.check_engine``); everything is written to a temporary
directory first and moved into place at the end.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import logging
import os
import platform
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from trt.errors import MissingDependencyError
from trt.manifest import (
    INPUT_IDS,
    LOGITS,
    MANIFEST_NAME,
    ONNX_NAME,
    PAST_DIM,
    SEQ_DIM,
    Manifest,
    TensorSpec,
    past_names,
    present_names,
)
from trt.onnx_drafter import ELEMENT_TYPES, OrtEngine
from trt.onnx_lint import lint_file
from trt.onnx_reference import ReferenceEngine
from trt.sources import DraftSource
from trt.step import DraftStep, check_engine, model_shape

log = logging.getLogger(__name__)

DEFAULT_OPSET = 20
MIN_OPSET = 18
# Sample lengths for tracing: both >= 2, so torch.export keeps the dimensions symbolic.
TRACE_PAST, TRACE_NEW = 5, 3
VERSIONED_PACKAGES = ("specserve", "torch", "transformers", "onnx", "onnxscript", "onnxruntime")


def export_onnx(
    source: DraftSource,
    out_dir: Path,
    dtype: str = "float32",
    opset: int = DEFAULT_OPSET,
    *,
    check: bool = True,
    progress: bool = False,
) -> Manifest:
    """Export ``source`` into ``out_dir`` (replacing an earlier export there)."""
    _require_export_packages()
    if opset < MIN_OPSET:
        raise ValueError(f"opset {opset} is too old; use {MIN_OPSET} or newer")
    _refuse_foreign_dir(out_dir)
    with _stages(progress, total=4 if check else 3) as stage:
        stage(f"loading {source.spec} ({dtype})")
        model = source.load_model(dtype)
        step = DraftStep(model)
        stage(f"tracing and converting to ONNX (opset {opset})")
        program = _trace(step, model_shape(model), opset)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        work.chmod(0o755)
        try:
            stage("saving")
            program.save(str(work / ONNX_NAME))
            del program
            manifest = _manifest(source, model, dtype, opset, work / ONNX_NAME)
            for problem in lint_file(str(work / ONNX_NAME)):
                log.warning("TensorRT is likely to refuse this export: %s", problem)
            if check:
                engine = (OrtEngine(work, manifest) if dtype in ELEMENT_TYPES
                          else ReferenceEngine(work, manifest))
                stage(f"checking against PyTorch on {engine.runtime}")
                result = check_engine(engine, step, dtype)
                del engine
                manifest = replace(manifest, check=result)
                log.info("export check: %s", result.summary)
            source.load_tokenizer().save_pretrained(work)
            manifest.save(work)
            _install(work, out_dir)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    log.info("exported %s to %s", source.spec, out_dir)
    return manifest


def _trace(step: DraftStep, shape: dict[str, int], opset: int) -> Any:
    model = step.model
    layers = shape["num_layers"]
    param = next(model.parameters())
    past = [torch.zeros((1, shape["num_kv_heads"], TRACE_PAST, shape["head_dim"]),
                        dtype=param.dtype) for _ in range(2 * layers)]
    ids = torch.zeros((1, TRACE_NEW), dtype=torch.long)  # [1, seq]
    seq = torch.export.Dim(SEQ_DIM, min=1, max=shape["max_positions"])
    past_len = torch.export.Dim(PAST_DIM, min=0, max=shape["max_positions"])
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings(), \
            _quiet_exporter():
        warnings.simplefilter("ignore")  # the exporter's notes on internals it handles
        return torch.onnx.export(
            step,
            (ids, past),
            dynamo=True,
            dynamic_shapes=({1: seq}, [{2: past_len}] * (2 * layers)),
            input_names=[INPUT_IDS, *past_names(layers)],
            output_names=[LOGITS, *present_names(layers)],
            opset_version=opset,
            verbose=False,
        )


def _manifest(source: DraftSource, model: Any, dtype: str, opset: int, onnx_path: Path
              ) -> Manifest:
    shape = model_shape(model)
    inputs, outputs = _io_specs(onnx_path)
    return Manifest(
        source_spec=source.spec,
        source_path=str(source.path),
        source_hash=source.fingerprint,
        architecture=type(model).__name__,
        dtype=dtype,
        opset=opset,
        onnx_file=ONNX_NAME,
        inputs=inputs,
        outputs=outputs,
        check=None,
        versions=_versions(),
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **shape,
    )


def _io_specs(onnx_path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Names, shapes and dtypes as the saved graph declares them."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph

    names = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
             onnx.TensorProto.BFLOAT16: "bfloat16", onnx.TensorProto.INT64: "int64"}

    def spec(value: Any) -> TensorSpec:
        tensor = value.type.tensor_type
        dims = tuple(d.dim_param or d.dim_value for d in tensor.shape.dim)
        return TensorSpec(value.name, dims, names.get(tensor.elem_type, str(tensor.elem_type)))

    return tuple(spec(v) for v in graph.input), tuple(spec(v) for v in graph.output)


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in VERSIONED_PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return versions


def _require_export_packages() -> None:
    for package in ("onnx", "onnxscript"):
        try:
            __import__(package)
        except ImportError as exc:
            raise MissingDependencyError(
                f"exporting a draft needs {package}, which is not installed: "
                "pip install 'specserve[onnx]'") from exc


def _refuse_foreign_dir(out_dir: Path) -> None:
    """Replace an earlier export, but never a directory holding something else."""
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST_NAME).exists():
        raise FileExistsError(
            f"{out_dir} is not empty and holds no draft export; choose another --out")


def _install(work: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        work.rename(out_dir)
        return
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    out_dir.rename(old)
    work.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter reports its phases on stdout (our progress goes to stderr) and logs
    notes about optional operator libraries it skips; keep both out of the way."""
    registry = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registry.level
    registry.setLevel(logging.ERROR)
    try:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            yield
    finally:
        registry.setLevel(level)


@contextlib.contextmanager
def _stages(enabled: bool, total: int) -> Iterator[Any]:
    """A one-line progress display on stderr: ``stage(description)`` starts the next stage."""
    from tqdm import tqdm

    bar = tqdm(total=total, file=sys.stderr, disable=not enabled, leave=True,
               bar_format="{desc} [{n_fmt}/{total_fmt} stages, {elapsed}]")
    started = False

    def stage(description: str) -> None:
        nonlocal started
        if started:
            bar.update(1)
        started = True
        bar.set_description_str(description)
        log.debug("export: %s", description)

    try:
        yield stage
        bar.update(1)
        bar.set_description_str("done")
    finally:
        bar.close()
