"""The TensorRT drafter's own logic on the CPU, with tests/trt/fake_tensorrt.py as TensorRT.

The stand-in checks what the engine hands TensorRT (aligned, non-null addresses,
shapes inside the profile, output sizes equal to ONNX Runtime's for the same step)
and runs the step on ONNX Runtime, so chunking, the engine cache and the error
paths run for real here; the GPU tests in test_tensorrt.py run the real thing.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams
from gateway.server import build_engine, create_app
from runtime.runner.causal_lm import CausalLM
from tests.conftest import KEPT_VARIABLES
from tests.gateway.conftest import in_process, tiny_settings
from tests.trt import fake_tensorrt
from trt import backends, tensorrt_build, tensorrt_drafter
from trt.backends import load_draft
from trt.kv_drafter import KVDrafter
from trt.manifest import INPUT_IDS, Manifest
from trt.onnx_drafter import OrtEngine
from trt.sources import DraftSource
from trt.step import TOLERANCES
from trt.store import NEXT_TO_DRAFT
from trt.tensorrt_build import (
    BuildSettings,
    EngineBuildError,
    EngineMismatchError,
    engine_key,
    engine_path,
)
from trt.tensorrt_drafter import TensorRTEngine, load_tensorrt_engine

CPU = torch.device("cpu")
SMALL_STEPS = BuildSettings(max_positions=512, max_step_tokens=8)


@pytest.fixture
def fake_trt(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The stand-in installed as ``tensorrt``, usable on this CPU."""
    fake_tensorrt.reset()
    tensorrt_build.shared_logger.cache_clear()
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt)
    monkeypatch.setattr(tensorrt_build, "tensorrt_unavailable_reason", lambda: None)
    monkeypatch.setattr(backends, "tensorrt_unavailable_reason", lambda: None)
    monkeypatch.setattr(tensorrt_drafter, "engine_device", lambda target: CPU)
    yield
    tensorrt_build.shared_logger.cache_clear()


@pytest.fixture
def export_dir(tmp_path: Path, tiny_draft_export: Path) -> Path:
    out = tmp_path / "export"
    shutil.copytree(tiny_draft_export, out)
    return out


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.usefixtures("fake_trt")
def test_long_steps_run_in_chunks_inside_the_profile(export_dir: Path,
                                                     tiny_draft_dir: Path) -> None:
    manifest = Manifest.load(export_dir)
    engine = load_tensorrt_engine(export_dir, manifest, CPU, SMALL_STEPS,
                                  reference=DraftSource.parse(str(tiny_draft_dir)))
    assert len(fake_tensorrt.RECORD.builds) == 1  # built, checked against PyTorch, stored
    (build,) = fake_tensorrt.RECORD.builds
    assert build["profile"][INPUT_IDS][2] == [1, 8]
    assert build["pools"] == {0: SMALL_STEPS.workspace_bytes}
    ids = _ids(21)
    cache = engine.empty_cache()
    fake_tensorrt.RECORD.executions.clear()
    got = engine.step(cache, ids)  # [vocab]
    assert [e[INPUT_IDS][1] for e in fake_tensorrt.RECORD.executions] == [8, 8, 5]
    assert [e["past_key_0"][2] for e in fake_tensorrt.RECORD.executions] == [0, 8, 16]
    ort = OrtEngine(export_dir)
    ort_cache = ort.empty_cache()
    expected = ort.step(ort_cache, ids)  # one 21-token step
    assert float((got - expected).abs().max()) <= TOLERANCES["float32"]
    assert cache.length == 21 and all(t.shape[2] == 21 for t in cache.tensors)
    for mine, theirs in zip(cache.tensors, ort_cache.tensors, strict=True):
        assert torch.allclose(mine, theirs, atol=1e-5)
    one = engine.step(cache, [5])
    assert float((one - ort.step(ort_cache, [5])).abs().max()) <= TOLERANCES["float32"]


@pytest.mark.usefixtures("fake_trt")
def test_the_stored_engine_is_reused_with_one_logger(export_dir: Path) -> None:
    manifest = Manifest.load(export_dir)
    load_tensorrt_engine(export_dir, manifest, CPU, SMALL_STEPS)
    load_tensorrt_engine(export_dir, manifest, CPU, SMALL_STEPS)
    assert len(fake_tensorrt.RECORD.builds) == 1
    assert fake_tensorrt.RECORD.loggers == 1  # one for the builder and every runtime
    # Other build settings are another engine, stored beside the first.
    other = BuildSettings(max_positions=512, max_step_tokens=16)
    load_tensorrt_engine(export_dir, manifest, CPU, other)
    assert len(fake_tensorrt.RECORD.builds) == 2
    first, second = (engine_path(export_dir, engine_key(manifest, s, CPU))
                     for s in (SMALL_STEPS, other))
    assert first != second and first.is_file() and second.is_file()
    assert engine_key(manifest, SMALL_STEPS, CPU) != engine_key(manifest, other, CPU)


@pytest.mark.usefixtures("fake_trt")
def test_a_damaged_stored_engine_is_rebuilt(export_dir: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    manifest = Manifest.load(export_dir)
    load_tensorrt_engine(export_dir, manifest, CPU, SMALL_STEPS)
    path = engine_path(export_dir, engine_key(manifest, SMALL_STEPS, CPU))
    path.write_bytes(b"\x00not an engine")
    with caplog.at_level(logging.WARNING, logger="trt.tensorrt_drafter"):
        engine = load_tensorrt_engine(export_dir, manifest, CPU, SMALL_STEPS)
    assert "unusable" in caplog.text and "building it again" in caplog.text
    assert len(fake_tensorrt.RECORD.builds) == 2
    assert path.read_bytes().startswith(b"{")  # the good engine replaced the damaged one
    assert engine.step(engine.empty_cache(), [1, 2, 3]).shape == (manifest.vocab_size,)


@pytest.mark.usefixtures("fake_trt")
def test_an_unwritable_export_directory_is_a_warning(export_dir: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    (export_dir / tensorrt_build.ENGINES_DIR).write_text("a file where the engines would go")
    manifest = Manifest.load(export_dir)
    with caplog.at_level(logging.WARNING, logger="trt.tensorrt_build"):
        engine = load_tensorrt_engine(export_dir, manifest, CPU, SMALL_STEPS)
    assert "could not store the TensorRT engine" in caplog.text
    assert engine.step(engine.empty_cache(), [1, 2, 3]).shape == (manifest.vocab_size,)


@pytest.mark.usefixtures("fake_trt")
def test_no_execution_context_is_a_clear_error(export_dir: Path) -> None:
    fake_tensorrt.FAULTS.no_context = True
    with pytest.raises(EngineBuildError, match=r"execution context.*3072 MiB.*8 new tokens"):
        load_tensorrt_engine(export_dir, Manifest.load(export_dir), CPU, SMALL_STEPS)


@pytest.mark.usefixtures("fake_trt")
def test_engine_io_names_are_checked_against_the_manifest(export_dir: Path) -> None:
    fake_tensorrt.FAULTS.renamed_outputs = {"logits": "output_0"}
    with pytest.raises(EngineMismatchError, match="output_0"):
        load_tensorrt_engine(export_dir, Manifest.load(export_dir), CPU, SMALL_STEPS)


@pytest.mark.usefixtures("fake_trt")
def test_a_failed_build_is_an_error(export_dir: Path) -> None:
    fake_tensorrt.FAULTS.build_fails = True
    with pytest.raises(EngineBuildError, match="failed to build"):
        load_tensorrt_engine(export_dir, Manifest.load(export_dir), CPU, SMALL_STEPS)


@pytest.mark.usefixtures("fake_trt")
def test_steps_outside_the_engine_are_refused(export_dir: Path) -> None:
    engine = load_tensorrt_engine(export_dir, Manifest.load(export_dir), CPU,
                                  BuildSettings(max_positions=16, max_step_tokens=8))
    with pytest.raises(ValueError, match="at most 16 positions"):
        engine.step(engine.empty_cache(), _ids(17))
    with pytest.raises(ValueError, match="at least one token"):
        engine.step(engine.empty_cache(), [])
    cache = engine.empty_cache()
    engine.step(cache, _ids(16))  # the whole context, in two calls
    assert cache.length == 16


@pytest.fixture
def draft_copy(tmp_path: Path, tiny_draft_dir: Path, tiny_draft_export: Path) -> Path:
    draft = tmp_path / "draft"
    shutil.copytree(tiny_draft_dir, draft)
    shutil.copytree(tiny_draft_export, draft / NEXT_TO_DRAFT)
    return draft


@pytest.mark.usefixtures("fake_trt")
def test_auto_picks_tensorrt_and_stays_lossless(tiny_target: CausalLM, tmp_path: Path,
                                                tiny_target_dir: Path) -> None:
    drafter, backend = load_draft(str(tiny_target_dir), tiny_target, "auto",
                                  export_root=tmp_path)
    assert backend == "tensorrt"
    assert isinstance(drafter, KVDrafter) and isinstance(drafter.engine, TensorRTEngine)
    prompt = tuple(tiny_target.tokenizer.encode("1, 2, 3, 4, 5, 6,"))
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=24,
                                sampling=SamplingParams(temperature=0.0))
    plain = [t for e in decode(tiny_target, None, request) for t in e.token_ids]
    events = list(decode(tiny_target, drafter, request))
    assert [t for e in events for t in e.token_ids] == plain
    assert sum(e.accepted_tokens for e in events) > 0  # the target drafting itself


@pytest.mark.usefixtures("fake_trt")
def test_auto_falls_back_to_onnx_then_torch_with_the_reason(
        tiny_target: CausalLM, draft_copy: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fake_tensorrt.FAULTS.no_context = True
    with caplog.at_level(logging.WARNING, logger="trt.backends"):
        drafter, backend = load_draft(str(draft_copy), tiny_target, "auto",
                                      export_root=tmp_path)
    assert backend.startswith("onnx (tensorrt: failed: TensorRT could not create an "
                              "execution context")
    assert isinstance(drafter, KVDrafter) and drafter.engine.runtime.startswith("onnxruntime")
    assert "tensorrt failed, trying the next backend" in caplog.text
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` fails
    drafter, backend = load_draft(str(draft_copy), tiny_target, "auto", export_root=tmp_path)
    assert backend.startswith("torch (tensorrt: failed: ")
    assert backend.endswith("; onnx: onnxruntime is not installed)")
    assert backends.backend_name(backend) == "torch"


@pytest.mark.usefixtures("fake_trt")
def test_an_export_directory_falls_back_too(tiny_target: CausalLM, export_dir: Path) -> None:
    fake_tensorrt.FAULTS.renamed_outputs = {"present_key_0": "present.0.key"}
    drafter, backend = load_draft(str(export_dir), tiny_target, "auto")
    assert backend.startswith("onnx (tensorrt: failed: the engine's inputs/outputs")
    assert isinstance(drafter, KVDrafter)


async def test_models_metadata_says_why_auto_fell_back(
        tiny_target_dir: Path, tiny_draft_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No stand-in here: on this machine TensorRT really is missing, and there is no export."""
    if tensorrt_build.tensorrt_unavailable_reason() is None:
        pytest.skip("TensorRT can run here, so auto does not fall back")
    for name in [n for n in os.environ if n.startswith("SPECSERVE_") and n not in KEPT_VARIABLES]:
        monkeypatch.delenv(name)  # the settings are this test's alone
    settings = tiny_settings(target=str(tiny_target_dir), draft=str(tiny_draft_dir),
                             draft_backend="auto", prefix_cache=False)
    engine = build_engine(settings, draft_loader=load_draft)
    try:
        async with in_process(create_app(settings, engine=engine)) as c:
            (card,) = (await c.get("/v1/models")).json()["data"]
    finally:
        engine.shutdown()
    reason = tensorrt_build.tensorrt_unavailable_reason()
    assert card["metadata"]["draft_backend"] == (
        f"torch (tensorrt: {reason}; onnx: no export of this draft yet)")

