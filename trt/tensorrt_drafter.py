"""The exported draft as a TensorRT engine on an NVIDIA GPU.

The KV cache, the token ids and the logits are CUDA torch tensors that the
engine reads and writes directly (``set_tensor_address`` with ``data_ptr()``),
and the step is enqueued with ``execute_async_v3`` on PyTorch's current stream,
so it is ordered with the surrounding torch work and nothing is copied through
the host. ``tensorrt`` is imported only when an engine is built or loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from decoding.target import CausalLM
from trt.kv_drafter import KVCache, KVDrafter
from trt.manifest import INPUT_IDS, LOGITS, Manifest
from trt.sources import DraftSource
from trt.step import DraftStep, check_engine
from trt.tensorrt_build import (
    EngineBuildError,
    build_engine,
    engine_key,
    engine_path,
    import_tensorrt,
    read_engine,
    require_tensorrt,
    save_engine,
)

log = logging.getLogger(__name__)


def _torch_dtypes(trt: Any) -> dict[Any, torch.dtype]:
    return {
        trt.DataType.FLOAT: torch.float32,
        trt.DataType.HALF: torch.float16,
        trt.DataType.BF16: torch.bfloat16,
        trt.DataType.INT64: torch.int64,
        trt.DataType.INT32: torch.int32,
    }


class TensorRTEngine:
    """Runs the exported decoding step with TensorRT (a ``StepEngine``)."""

    def __init__(self, serialized: bytes, manifest: Manifest, device: torch.device,
                 max_positions: int) -> None:
        trt = import_tensorrt()
        self.manifest = manifest
        self.device = device
        self.max_positions = max_positions
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        with torch.cuda.device(device):
            self.engine = self._runtime.deserialize_cuda_engine(serialized)
            if self.engine is None:
                raise EngineBuildError(
                    "TensorRT could not load the engine (built by another TensorRT version "
                    "or for another GPU?); delete it to rebuild")
            self.context = self.engine.create_execution_context()
        dtypes = _torch_dtypes(trt)
        self._dtypes = {
            name: dtypes[self.engine.get_tensor_dtype(name)]
            for name in (self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors))
        }
        self._past_names = manifest.past_names
        self._present_names = manifest.present_names
        self._kv_dtype = self._dtypes[self._past_names[0]]
        # TensorRT wants an address even for an empty tensor (an empty past).
        self._scratch = torch.zeros(16, dtype=self._kv_dtype, device=device)
        self.runtime = f"tensorrt {trt.__version__} ({torch.cuda.get_device_name(device)})"
        self.vocab_size = manifest.vocab_size

    def empty_cache(self) -> KVCache:
        m = self.manifest
        shape = (1, m.num_kv_heads, 0, m.head_dim)
        return KVCache([torch.empty(shape, dtype=self._kv_dtype, device=self.device)
                        for _ in self._past_names])

    def step(self, cache: KVCache, token_ids: Sequence[int]) -> torch.Tensor:  # [vocab]
        m = self.manifest
        total = cache.length + len(token_ids)
        if total > self.max_positions:
            raise ValueError(f"the draft engine holds at most {self.max_positions} positions")
        ids = torch.tensor([list(token_ids)], dtype=self._dtypes[INPUT_IDS],
                           device=self.device)  # [1, n]
        logits = torch.empty((1, m.vocab_size), dtype=self._dtypes[LOGITS],
                             device=self.device)  # [1, vocab]
        presents = [  # [1, kv_heads, total, head_dim] each
            torch.empty((1, m.num_kv_heads, total, m.head_dim), dtype=self._kv_dtype,
                        device=self.device)
            for _ in self._present_names
        ]
        self._input(INPUT_IDS, ids)
        for name, tensor in zip(self._past_names, cache.tensors, strict=True):
            self._input(name, tensor)
        self._output(LOGITS, logits)
        for name, tensor in zip(self._present_names, presents, strict=True):
            self._output(name, tensor)
        stream = torch.cuda.current_stream(self.device)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT failed to enqueue the draft step")
        cache.tensors = presents
        cache.length = total
        return logits[0]

    def _input(self, name: str, tensor: torch.Tensor) -> None:
        if not self.context.set_input_shape(name, tuple(tensor.shape)):
            raise ValueError(f"{name} shape {tuple(tensor.shape)} is outside the engine's profile")
        self.context.set_tensor_address(name, self._address(tensor))

    def _output(self, name: str, tensor: torch.Tensor) -> None:
        self.context.set_tensor_address(name, self._address(tensor))

    def _address(self, tensor: torch.Tensor) -> int:
        return tensor.data_ptr() if tensor.numel() else self._scratch.data_ptr()


def load_tensorrt_engine(
    export_dir: Path,
    manifest: Manifest,
    device: torch.device,
    max_positions: int,
    reference: DraftSource | None = None,
) -> TensorRTEngine:
    """Reuse the stored engine for this GPU and TensorRT, or build, check and store one.

    ``reference`` (the draft's source model) lets a new engine be checked against
    PyTorch on the GPU before it is stored; without it the check is skipped.
    """
    require_tensorrt()
    key = engine_key(manifest, max_positions, device)
    path = engine_path(export_dir, key)
    data = read_engine(path, key)
    if data is not None:
        log.info("reusing TensorRT engine %s", path)
        return TensorRTEngine(data, manifest, device, max_positions)
    data = build_engine(export_dir / manifest.onnx_file, manifest, max_positions)
    engine = TensorRTEngine(data, manifest, device, max_positions)
    if reference is not None:
        step = DraftStep(reference.load_model(manifest.dtype, str(device)))
        result = check_engine(engine, step, manifest.dtype)
        log.info("engine check: max |logits diff| %.3g (tolerance %g)",
                 result.max_abs_logits_diff, result.tolerance)
        del step
    else:
        log.warning("the draft's source model is not available; the new engine is unchecked")
    save_engine(path, key, data)
    log.info("stored TensorRT engine %s", path)
    return engine


def load_tensorrt_drafter(
    export_dir: Path,
    manifest: Manifest,
    target: CausalLM,
    tokenizer: Any,
    reference: DraftSource | None = None,
) -> KVDrafter:
    device = target.device if target.device.type == "cuda" else torch.device("cuda", 0)
    max_positions = min(manifest.max_positions, target.max_context)
    engine = load_tensorrt_engine(export_dir, manifest, device, max_positions, reference)
    log.info("draft %s on %s", manifest.source_spec, engine.runtime)
    return KVDrafter(engine, tokenizer, target)
