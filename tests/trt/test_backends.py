"""Backend selection, the export cache, and clear errors for unavailable backends."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafters.combined import CombinedDrafter
from drafters.model import ModelDrafter
from drafters.ngram import NgramDrafter
from runtime.runner.causal_lm import CausalLM
from trt import export
from trt.backends import backend_name, load_draft
from trt.errors import DraftBackendError, MissingDependencyError
from trt.kv_drafter import KVDrafter
from trt.manifest import ONNX_NAME, Manifest
from trt.sources import DraftSource
from trt.store import NEXT_TO_DRAFT, cache_dir
from trt.tensorrt_build import tensorrt_unavailable_reason

needs_no_tensorrt = pytest.mark.skipif(
    tensorrt_unavailable_reason() is None, reason="TensorRT can run here, so auto picks it")


@pytest.fixture
def export_calls(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Directories exported into during the test (export.export_onnx still runs)."""
    calls: list[Path] = []
    real = export.export_onnx

    def counting(source: DraftSource, out_dir: Path, *args: Any, **kwargs: Any) -> Manifest:
        calls.append(out_dir)
        return real(source, out_dir, *args, **kwargs)

    monkeypatch.setattr(export, "export_onnx", counting)
    return calls


@pytest.fixture
def draft_copy(tmp_path: Path, tiny_draft_dir: Path, tiny_draft_export: Path) -> Path:
    """A private copy of the tiny draft, its current export next to it in onnx/."""
    draft = tmp_path / "draft"
    shutil.copytree(tiny_draft_dir, draft)
    shutil.copytree(tiny_draft_export, draft / NEXT_TO_DRAFT)
    return draft


def test_torch_backend(tiny_target: CausalLM, tiny_draft_dir: Path) -> None:
    drafter, backend = load_draft(str(tiny_draft_dir), tiny_target, "torch")
    assert isinstance(drafter, ModelDrafter) and backend == "torch"


@pytest.mark.parametrize(("spec", "kind", "backend"),
                         [("ngram", NgramDrafter, "builtin"), ("none", type(None), "none")])
def test_drafts_without_a_model(tiny_target: CausalLM, spec: str, kind: type,
                                backend: str) -> None:
    drafter, chosen = load_draft(spec, tiny_target, "auto")
    assert isinstance(drafter, kind) and chosen == backend
    with pytest.raises(DraftBackendError, match="runs a draft model"):
        load_draft(spec, tiny_target, "onnx")


def test_a_combined_spec_runs_its_model_on_the_backend(tiny_target: CausalLM,
                                                       tiny_draft_export: Path) -> None:
    drafter, backend = load_draft(f"ngram+{tiny_draft_export}", tiny_target, "onnx")
    assert backend == "onnx" and isinstance(drafter, CombinedDrafter)
    assert isinstance(drafter.cheap[0], NgramDrafter) and isinstance(drafter.model, KVDrafter)
    assert drafter.name == f"ngram+{tiny_draft_export}"  # as typed: requests use it


def test_onnx_exports_once_then_reuses(tiny_target: CausalLM, tiny_draft_dir: Path,
                                       tmp_path: Path, export_calls: list[Path]) -> None:
    first, backend = load_draft(str(tiny_draft_dir), tiny_target, "onnx", export_root=tmp_path)
    assert isinstance(first, KVDrafter) and backend == "onnx"
    out = cache_dir(DraftSource.parse(str(tiny_draft_dir)), "float32", tmp_path)
    assert export_calls == [out]
    stamp = (out / ONNX_NAME).stat().st_mtime_ns
    second, _ = load_draft(str(tiny_draft_dir), tiny_target, "onnx", export_root=tmp_path)
    assert isinstance(second, KVDrafter)
    assert export_calls == [out]  # no second export
    assert (out / ONNX_NAME).stat().st_mtime_ns == stamp


@needs_no_tensorrt
def test_auto_prefers_a_current_export(tiny_target: CausalLM, draft_copy: Path,
                                       tmp_path: Path, export_calls: list[Path]) -> None:
    why_not_tensorrt = f"tensorrt: {tensorrt_unavailable_reason()}"
    drafter, backend = load_draft(str(draft_copy), tiny_target, "auto", export_root=tmp_path)
    assert backend == f"onnx ({why_not_tensorrt})" and isinstance(drafter, KVDrafter)
    shutil.rmtree(draft_copy / NEXT_TO_DRAFT)
    drafter, backend = load_draft(str(draft_copy), tiny_target, "auto", export_root=tmp_path)
    assert backend == f"torch ({why_not_tensorrt}; onnx: no export of this draft yet)"
    assert isinstance(drafter, ModelDrafter)
    assert export_calls == []  # auto never exports for ONNX Runtime


def _change_weights(model_dir: Path) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    name = next(n for n, t in tensors.items() if t.dim() == 2)
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, path, metadata={"format": "pt"})


def test_changed_weights_invalidate_the_export(tiny_target: CausalLM, draft_copy: Path,
                                               tmp_path: Path, export_calls: list[Path]) -> None:
    root = tmp_path / "exports"
    _, backend = load_draft(str(draft_copy), tiny_target, "onnx", export_root=root)
    assert backend == "onnx" and export_calls == []  # the export next to the draft is current
    old_hash = Manifest.load(draft_copy / NEXT_TO_DRAFT).source_hash
    _change_weights(draft_copy)
    if tensorrt_unavailable_reason() is not None:  # auto ignores the stale export
        backend = load_draft(str(draft_copy), tiny_target, "auto", export_root=root)[1]
        assert backend_name(backend) == "torch" and "changed since it was exported" in backend
    _, backend = load_draft(str(draft_copy), tiny_target, "onnx", export_root=root)
    assert backend == "onnx"
    assert len(export_calls) == 1  # exported again, into the cache
    fresh = Manifest.load(export_calls[0])
    assert fresh.source_hash == DraftSource.parse(str(draft_copy)).fingerprint != old_hash


def test_an_export_directory_is_a_draft(tiny_target: CausalLM, tiny_draft_export: Path) -> None:
    drafter, backend = load_draft(str(tiny_draft_export), tiny_target, "onnx")
    assert isinstance(drafter, KVDrafter) and backend == "onnx"
    drafter, backend = load_draft(str(tiny_draft_export), tiny_target, "torch")
    assert isinstance(drafter, ModelDrafter) and backend == "torch"  # from the source model


def test_unknown_backend(tiny_target: CausalLM, tiny_draft_dir: Path) -> None:
    with pytest.raises(DraftBackendError, match="auto, torch, onnx, tensorrt"):
        load_draft(str(tiny_draft_dir), tiny_target, "cuda")


@needs_no_tensorrt
def test_tensorrt_unavailable_is_a_startup_error(tiny_target: CausalLM,
                                                 tiny_draft_dir: Path) -> None:
    with pytest.raises(DraftBackendError, match="TensorRT"):
        load_draft(str(tiny_draft_dir), tiny_target, "tensorrt")


def test_onnx_without_onnxruntime(tiny_target: CausalLM, tiny_draft_dir: Path,
                                  monkeypatch: pytest.MonkeyPatch,
                                  export_calls: list[Path]) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` fails
    with pytest.raises(MissingDependencyError, match=r"pip install 'specserve\[onnx\]'"):
        load_draft(str(tiny_draft_dir), tiny_target, "onnx")
    if tensorrt_unavailable_reason() is not None:
        backend = load_draft(str(tiny_draft_dir), tiny_target, "auto")[1]
        assert backend.endswith("; onnx: onnxruntime is not installed)")
    assert export_calls == []


def test_onnx_bfloat16_runs_a_float32_export_on_cpu(tiny_target: CausalLM, draft_copy: Path,
                                                    export_calls: list[Path],
                                                    tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("the CUDA provider may run other dtypes")
    drafter, backend = load_draft(str(draft_copy), tiny_target, "onnx", "bfloat16",
                                  export_root=tmp_path)
    assert backend == "onnx" and export_calls == []
    assert isinstance(drafter, KVDrafter)
    assert drafter.engine.runtime.startswith("onnxruntime")


