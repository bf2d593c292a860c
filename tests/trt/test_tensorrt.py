"""The TensorRT drafter: profile and cache keys everywhere, the engine itself on a GPU."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from decoding.sequence import decode
from decoding.target import CausalLM
from decoding.types import GenerationRequest, SamplingParams
from trt import tensorrt_drafter
from trt.errors import DraftBackendError
from trt.manifest import Manifest
from trt.sources import DraftSource
from trt.step import TOLERANCES
from trt.tensorrt_build import EngineKey, profile_shapes, tensorrt_unavailable_reason


def test_profile_covers_empty_past_to_full_context(tiny_draft_export: Path) -> None:
    manifest = Manifest.load(tiny_draft_export)
    shapes = profile_shapes(manifest, max_positions=512)
    assert set(shapes) == {"input_ids", *manifest.past_names}
    assert shapes["input_ids"] == ((1, 1), (1, 1), (1, 512))
    low, opt, high = shapes["past_key_0"]
    heads, dim = manifest.num_kv_heads, manifest.head_dim
    assert low == (1, heads, 0, dim) and high == (1, heads, 511, dim)
    assert 0 < opt[2] < 511


def test_engine_file_names_gpu_and_tensorrt_version() -> None:
    key = EngineKey(gpu="NVIDIA H100 80GB HBM3", compute_capability="90", tensorrt="10.8.0",
                    dtype="float16", max_positions=8192, source_hash="sha256:ab",
                    export_created="2025-01-01T00:00:00+00:00")
    assert key.filename == "nvidia-h100-80gb-hbm3-sm90-trt10.8.0-float16-ctx8192.engine"


@pytest.mark.skipif(tensorrt_unavailable_reason() is None, reason="TensorRT can run here")
def test_engine_needs_tensorrt_and_a_gpu(tiny_draft_export: Path, tiny_target: CausalLM) -> None:
    manifest = Manifest.load(tiny_draft_export)
    with pytest.raises(DraftBackendError, match="TensorRT"):
        tensorrt_drafter.load_tensorrt_drafter(tiny_draft_export, manifest, tiny_target, None)


@pytest.fixture
def gpu_target(tiny_target_dir: Path) -> CausalLM:
    pytest.importorskip("tensorrt", reason="TensorRT is not installed on this GPU machine")
    return CausalLM.load(str(tiny_target_dir), device="cuda")


@pytest.mark.gpu
def test_engine_matches_pytorch_and_is_reused(tmp_path: Path, tiny_draft_export: Path,
                                              tiny_draft_dir: Path, gpu_target: CausalLM,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    export_dir = tmp_path / "export"
    shutil.copytree(tiny_draft_export, export_dir)
    manifest = Manifest.load(export_dir)
    source = DraftSource.parse(str(tiny_draft_dir))
    builds: list[Any] = []
    real_build = tensorrt_drafter.build_engine

    def counting(*args: Any) -> bytes:
        builds.append(args)
        return real_build(*args)

    monkeypatch.setattr(tensorrt_drafter, "build_engine", counting)
    device = torch.device("cuda")
    engine = tensorrt_drafter.load_tensorrt_engine(export_dir, manifest, device, 512, source)
    assert len(builds) == 1  # built, checked against PyTorch on the GPU, stored
    draft = source.load_causal_lm("float32", "cuda")
    ids = list(range(10, 30))
    cache = engine.empty_cache()
    engine.step(cache, ids[:12])
    got = engine.step(cache, ids[12:])
    state = draft.new_state()
    expected = draft.prefill(state, ids)
    assert float((got.float() - expected.float()).abs().max()) <= TOLERANCES["float32"]
    tensorrt_drafter.load_tensorrt_engine(export_dir, manifest, device, 512, source)
    assert len(builds) == 1  # the stored engine was reused


@pytest.mark.gpu
def test_tensorrt_greedy_speculation_is_lossless(tmp_path: Path, tiny_target_export: Path,
                                                 tiny_target_dir: Path,
                                                 gpu_target: CausalLM) -> None:
    export_dir = tmp_path / "export"
    shutil.copytree(tiny_target_export, export_dir)
    drafter = tensorrt_drafter.load_tensorrt_drafter(
        export_dir, Manifest.load(export_dir), gpu_target,
        gpu_target.tokenizer, reference=DraftSource.parse(str(tiny_target_dir)))
    prompt = tuple(gpu_target.tokenizer.encode("1, 2, 3, 4, 5, 6,"))
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=32,
                                sampling=SamplingParams(temperature=0.0))
    plain = [t for e in decode(gpu_target, None, request) for t in e.token_ids]
    events = list(decode(gpu_target, drafter, request))
    assert [t for e in events for t in e.token_ids] == plain
    assert sum(e.accepted_tokens for e in events) > 0
