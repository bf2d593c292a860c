"""The TensorRT drafter: profile and cache keys everywhere, the engine itself on a GPU.

The GPU tests need an NVIDIA GPU and the tensorrt package; elsewhere they skip
with the reason (tests/trt/test_tensorrt_standin.py covers the engine's logic on
the CPU with a stand-in for TensorRT).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams
from runtime.runner.causal_lm import CausalLM, TransformersLM
from trt import tensorrt_drafter
from trt.errors import DraftBackendError
from trt.export import export_onnx
from trt.manifest import Manifest
from trt.sources import DraftSource
from trt.step import TOLERANCES, TOP_K, top_k_agree
from trt.tensorrt_build import (
    MAX_STEP_TOKENS,
    BuildSettings,
    EngineKey,
    profile_shapes,
    tensorrt_unavailable_reason,
)

KEY = EngineKey(gpu="NVIDIA H100 80GB HBM3", compute_capability="90", tensorrt="10.13.3.9",
                dtype="float16", source_hash="sha256:ab",
                export_created="2025-01-01T00:00:00+00:00", max_positions=8192,
                max_step_tokens=128, opt_past=256, workspace_bytes=1 << 30)


def test_profile_caps_new_tokens_and_covers_the_context(tiny_draft_export: Path) -> None:
    manifest = Manifest.load(tiny_draft_export)
    shapes = profile_shapes(manifest, BuildSettings(max_positions=512))
    assert set(shapes) == {"input_ids", *manifest.past_names}
    assert shapes["input_ids"] == ((1, 1), (1, 1), (1, MAX_STEP_TOKENS))
    low, opt, high = shapes["past_key_0"]
    heads, dim = manifest.num_kv_heads, manifest.head_dim
    assert low == (1, heads, 0, dim) and high == (1, heads, 511, dim)
    assert 0 < opt[2] < 511
    short = profile_shapes(manifest, BuildSettings(max_positions=64))
    assert short["input_ids"][2] == (1, 64)  # never more new tokens than positions


def test_engine_file_names_gpu_tensorrt_and_settings() -> None:
    assert KEY.filename.startswith("nvidia-h100-80gb-hbm3-sm90-trt10.13.3.9-float16-ctx8192-")
    assert KEY.filename.endswith(".engine")
    for change in ({"opt_past": 512}, {"workspace_bytes": 2 << 30}, {"max_step_tokens": 64}):
        other = replace(KEY, **change)  # type: ignore[arg-type]
        assert other.filename != KEY.filename, change


@pytest.mark.skipif(tensorrt_unavailable_reason() is None, reason="TensorRT can run here")
def test_engine_needs_tensorrt_and_a_gpu(tiny_draft_export: Path, tiny_target: CausalLM) -> None:
    manifest = Manifest.load(tiny_draft_export)
    with pytest.raises(DraftBackendError, match="TensorRT"):
        tensorrt_drafter.load_tensorrt_drafter(tiny_draft_export, manifest, tiny_target, None)


@pytest.fixture
def gpu_target(tiny_target_dir: Path) -> CausalLM:
    pytest.importorskip("tensorrt", reason="TensorRT is not installed on this GPU machine")
    return TransformersLM.load(str(tiny_target_dir), device="cuda")


@pytest.fixture(params=["float32", "bfloat16"])
def gpu_export(request: pytest.FixtureRequest, tmp_path: Path, tiny_draft_export: Path,
               tiny_draft_dir: Path) -> tuple[Path, str]:
    """The tiny draft's export in each engine precision (bfloat16 made here, unchecked:
    the engine build checks it against PyTorch on the GPU)."""
    dtype = str(request.param)
    out = tmp_path / f"export-{dtype}"
    if dtype == "float32":
        shutil.copytree(tiny_draft_export, out)
    else:
        export_onnx(DraftSource.parse(str(tiny_draft_dir)), out, dtype, check=False)
    return out, dtype


@pytest.mark.gpu
def test_engine_matches_pytorch_and_is_reused(gpu_export: tuple[Path, str],
                                              tiny_draft_dir: Path, gpu_target: CausalLM,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    export_dir, dtype = gpu_export
    manifest = Manifest.load(export_dir)
    source = DraftSource.parse(str(tiny_draft_dir))
    builds: list[Any] = []
    real_build = tensorrt_drafter.build_engine

    def counting(*args: Any) -> bytes:
        builds.append(args)
        return real_build(*args)

    monkeypatch.setattr(tensorrt_drafter, "build_engine", counting)
    device = torch.device("cuda")
    settings = BuildSettings(max_positions=512, max_step_tokens=8)
    engine = tensorrt_drafter.load_tensorrt_engine(export_dir, manifest, device, settings,
                                                   source)
    assert len(builds) == 1  # built, checked against PyTorch on the GPU, stored
    draft = source.load_causal_lm(dtype, "cuda")
    ids = list(range(10, 30))
    cache = engine.empty_cache()
    engine.step(cache, ids[:12])  # two engine calls: the profile takes 8 tokens at most
    got = engine.step(cache, ids[12:]).float()  # [vocab]
    torch.cuda.synchronize()
    expected = draft.prefill(draft.new_state(), ids).float()  # [vocab]
    if dtype == "float32":
        assert float((got - expected).abs().max()) <= TOLERANCES["float32"]
    else:
        assert top_k_agree(got.cpu(), expected.cpu(), TOP_K)
    tensorrt_drafter.load_tensorrt_engine(export_dir, manifest, device, settings, source)
    assert len(builds) == 1  # the stored engine was reused


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tensorrt_greedy_speculation_is_lossless(tmp_path: Path, tiny_target_export: Path,
                                                 tiny_target_dir: Path, gpu_target: CausalLM,
                                                 dtype: str) -> None:
    export_dir = tmp_path / "export"
    source = DraftSource.parse(str(tiny_target_dir))
    if dtype == "float32":
        shutil.copytree(tiny_target_export, export_dir)
    else:
        export_onnx(source, export_dir, dtype, check=False)
    drafter = tensorrt_drafter.load_tensorrt_drafter(
        export_dir, Manifest.load(export_dir), gpu_target, gpu_target.tokenizer,
        reference=source)
    prompt = tuple(gpu_target.tokenizer.encode("1, 2, 3, 4, 5, 6,"))
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=32,
                                sampling=SamplingParams(temperature=0.0))
    plain = [t for e in decode(gpu_target, None, request) for t in e.token_ids]
    events = list(decode(gpu_target, drafter, request))
    assert [t for e in events for t in e.token_ids] == plain  # lossless whatever the draft
    assert sum(e.accepted_tokens for e in events) > 0
