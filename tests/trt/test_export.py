"""ONNX export: the graph's interface, the manifest, and agreement with PyTorch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from runtime.runner.causal_lm import CausalLM
from trt.export import export_onnx
from trt.manifest import ONNX_NAME, Manifest
from trt.onnx_drafter import OrtEngine
from trt.sources import DraftSource
from trt.step import TOLERANCES

ExportCli = Callable[[Sequence[str]], int]


@pytest.mark.parametrize(("past", "new"), [(0, 1), (0, 6), (1, 1), (7, 1), (7, 3), (40, 5)])
def test_onnx_logits_match_pytorch(tiny_draft: CausalLM, tiny_draft_export: Path,
                                   past: int, new: int) -> None:
    """ONNX Runtime (its own KV cache) against the PyTorch runner ModelDrafter uses."""
    engine = OrtEngine(tiny_draft_export)
    ids = torch.randint(0, tiny_draft.vocab_size, (past + new,),
                        generator=torch.Generator().manual_seed(past * 100 + new)).tolist()
    state = tiny_draft.new_state()
    cache = engine.empty_cache()
    if past:
        tiny_draft.prefill(state, ids[:past])
        engine.step(cache, ids[:past])
    expected = tiny_draft.prefill(state, ids[past:])  # [vocab]
    got = engine.step(cache, ids[past:])  # [vocab]
    assert got.shape == expected.shape
    assert float((got - expected).abs().max()) <= TOLERANCES["float32"]
    assert cache.length == past + new
    assert all(t.shape[2] == past + new for t in cache.tensors)


def test_manifest_records_interface_source_and_check(tiny_draft_export: Path,
                                                     tiny_draft_dir: Path) -> None:
    manifest = Manifest.load(tiny_draft_export)
    source = DraftSource.parse(str(tiny_draft_dir))
    assert manifest.source_hash == source.fingerprint
    assert manifest.dtype == "float32"
    assert (tiny_draft_export / manifest.onnx_file).is_file()
    heads, dim = manifest.num_kv_heads, manifest.head_dim
    inputs = {t.name: t for t in manifest.inputs}
    outputs = {t.name: t for t in manifest.outputs}
    assert list(inputs) == ["input_ids", *manifest.past_names]
    assert list(outputs) == ["logits", *manifest.present_names]
    assert inputs["input_ids"].shape == (1, "seq") and inputs["input_ids"].dtype == "int64"
    assert inputs["past_key_0"].shape == (1, heads, "past", dim)
    assert outputs["logits"].shape == (1, manifest.vocab_size)
    assert outputs["present_value_0"].shape[2] == "past + seq"
    assert manifest.check is not None
    assert (0, 1) in manifest.check.cases  # an empty past was checked
    assert manifest.check.max_abs_logits_diff <= manifest.check.tolerance
    assert {"torch", "transformers", "onnx", "onnxruntime"} <= set(manifest.versions)


def test_cli_skips_an_up_to_date_export(export_cli: ExportCli, tiny_draft_export: Path,
                                        tiny_draft_dir: Path) -> None:
    before = (tiny_draft_export / ONNX_NAME).stat().st_mtime_ns
    assert export_cli(["export-draft", "--draft", str(tiny_draft_dir),
                       "--out", str(tiny_draft_export), "--quiet"]) == 0
    assert (tiny_draft_export / ONNX_NAME).stat().st_mtime_ns == before


def test_float16_export_runs_on_onnx_runtime(tmp_path: Path, tiny_draft_dir: Path,
                                             tiny_draft: CausalLM) -> None:
    manifest = export_onnx(DraftSource.parse(str(tiny_draft_dir)), tmp_path / "fp16",
                           dtype="float16")
    assert manifest.dtype == "float16"
    assert manifest.check is not None
    assert manifest.check.max_abs_logits_diff <= TOLERANCES["float16"]
    engine = OrtEngine(tmp_path / "fp16")
    ids = [1, 2, 3, 4, 5]
    got = engine.step(engine.empty_cache(), ids).float()
    expected = tiny_draft.prefill(tiny_draft.new_state(), ids)
    assert float((got - expected).abs().max()) <= TOLERANCES["float16"]


def test_cli_needs_a_draft(export_cli: ExportCli, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SPECSERVE_DRAFT", raising=False)
    assert export_cli(["export-draft"]) == 2
    assert "default-truncated:N" in capsys.readouterr().err


def test_cli_refuses_tensorrt_without_it(
    export_cli: ExportCli, tiny_draft_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; TensorRT may well work")
    message = "TensorRT"
    status = export_cli(["export-draft", "--draft", str(tiny_draft_dir),
                         "--out", str(tmp_path / "out"), "--quiet", "--format", "tensorrt"])
    assert status == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_never_overwrites_a_foreign_directory(export_cli: ExportCli, tiny_draft_dir: Path,
                                                  tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    assert export_cli(["export-draft", "--draft", str(tiny_draft_dir), "--out", str(tmp_path),
                       "--quiet"]) == 1
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_truncated_spec_keeps_the_first_layers(default_model_dir: Path) -> None:
    source = DraftSource.parse("default-truncated:2")
    assert source.path == default_model_dir.resolve()
    assert source.load_config().num_hidden_layers == 2
    assert source.key != DraftSource.parse("default-truncated:3").key
