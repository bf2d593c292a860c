"""The exported draft as a TensorRT engine on an NVIDIA GPU.

The KV cache, the token ids and the logits are torch tensors that the engine
reads and writes directly (``set_tensor_address`` with ``data_ptr()``, each
256-byte aligned as TensorRT requires), so nothing is copied through the host.
A step is enqueued with ``execute_async_v3`` on the engine's own CUDA stream,
which first waits for the caller's current stream and which the caller's stream
then waits for, so it stays ordered with the surrounding torch work without
the legacy default stream's extra synchronisations. A step of more tokens than
the optimisation profile allows (a long prompt) runs as several engine calls.
``tensorrt`` is imported only when an engine is built or loaded.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from runtime.runner.causal_lm import CausalLM
from trt.kv_drafter import KVCache, KVDrafter
from trt.manifest import INPUT_IDS, LOGITS, Manifest
from trt.sources import DraftSource
from trt.step import DraftStep, check_engine
from trt.tensorrt_build import (
    BuildSettings,
    EngineBuildError,
    EngineMismatchError,
    build_engine,
    device_identity,
    engine_key,
    engine_path,
    import_tensorrt,
    read_engine,
    require_tensorrt,
    save_engine,
    shared_logger,
)

log = logging.getLogger(__name__)

ALIGNMENT = 256  # bytes; TensorRT's requirement for every I/O tensor address
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.int64: "int64", torch.int32: "int32"}


def _torch_dtypes(trt: Any) -> dict[Any, torch.dtype]:
    return {
        trt.DataType.FLOAT: torch.float32,
        trt.DataType.HALF: torch.float16,
        trt.DataType.BF16: torch.bfloat16,
        trt.DataType.INT64: torch.int64,
        trt.DataType.INT32: torch.int32,
    }


def aligned_empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device
                  ) -> torch.Tensor:
    """An uninitialised contiguous tensor whose data starts on an ``ALIGNMENT`` boundary."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, device=device)
    offset = -raw.data_ptr() % ALIGNMENT
    return raw[offset:offset + nbytes].view(dtype).view(tuple(shape))


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when contiguous and aligned, else an aligned copy."""
    if tensor.is_contiguous() and tensor.data_ptr() % ALIGNMENT == 0:
        return tensor
    copy = aligned_empty(tensor.shape, tensor.dtype, tensor.device)
    copy.copy_(tensor)
    return copy


class TensorRTEngine:
    """Runs the exported decoding step with TensorRT (a ``StepEngine``)."""

    def __init__(self, serialized: bytes, manifest: Manifest, device: torch.device,
                 settings: BuildSettings) -> None:
        trt = import_tensorrt()
        self.manifest = manifest
        self.device = device
        self.settings = settings
        self.max_positions = settings.max_positions
        self.max_step_tokens = settings.step_tokens
        on_gpu = device.type == "cuda"  # the CPU only under the tests' stand-in for TensorRT
        self._runtime = trt.Runtime(shared_logger(trt))
        with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
            self.engine = self._runtime.deserialize_cuda_engine(serialized)
            if self.engine is None:
                raise EngineBuildError(
                    "TensorRT could not load the engine (built by another TensorRT version "
                    "or for another GPU, or the file is damaged)")
            self._dtypes = self._check_io(trt)
            self.context = self.engine.create_execution_context()
            if self.context is None:
                raise EngineBuildError(self._no_context_message())
            self._stream = torch.cuda.Stream(device) if on_gpu else None
        self._past_names = manifest.past_names
        self._present_names = manifest.present_names
        self._kv_dtype = self._dtypes[self._past_names[0]]
        # TensorRT wants an address even for an empty tensor (an empty past).
        self._scratch = aligned_empty((64,), self._kv_dtype, device)
        self.runtime = f"tensorrt {trt.__version__} ({device_identity(device)[0]})"
        self.vocab_size = manifest.vocab_size

    def _check_io(self, trt: Any) -> dict[str, torch.dtype]:
        """The engine's I/O dtypes by name, after checking them against the manifest."""
        engine = self.engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        found = {n: engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        expected = {**{t.name: True for t in self.manifest.inputs},
                    **{t.name: False for t in self.manifest.outputs}}
        if found != expected:
            raise EngineMismatchError(
                f"the engine's inputs/outputs {_io_names(found)} are not the export's "
                f"{_io_names(expected)}")
        known = _torch_dtypes(trt)
        dtypes = {n: known.get(engine.get_tensor_dtype(n)) for n in names}
        specs = {t.name: t.dtype for t in (*self.manifest.inputs, *self.manifest.outputs)}
        wrong = [f"{n} is {dtypes[n]}, the export says {specs[n]}" for n in names
                 if DTYPE_NAMES.get(dtypes[n]) != specs[n]]  # type: ignore[arg-type]
        if wrong:
            raise EngineMismatchError("engine dtypes differ from the export: " + "; ".join(wrong))
        return {n: d for n, d in dtypes.items() if d is not None}

    def _no_context_message(self) -> str:
        engine = self.engine
        size = getattr(engine, "device_memory_size_v2", None)
        need = f" it needs {size / 2**20:.0f} MiB of GPU memory," if size else ""
        s = self.settings
        return (f"TensorRT could not create an execution context for the draft engine "
                f"(out of GPU memory?):{need} enough for {s.step_tokens} new tokens after "
                f"{s.max_past} past ones; free GPU memory or serve a shorter --max-context")

    def empty_cache(self) -> KVCache:
        m = self.manifest
        shape = (1, m.num_kv_heads, 0, m.head_dim)
        return KVCache([torch.empty(shape, dtype=self._kv_dtype, device=self.device)
                        for _ in self._past_names])

    def step(self, cache: KVCache, token_ids: Sequence[int]) -> torch.Tensor:  # [vocab]
        if not token_ids:
            raise ValueError("a draft step needs at least one token")
        if cache.length + len(token_ids) > self.max_positions:
            raise ValueError(f"the draft engine holds at most {self.max_positions} positions")
        logits = None
        for start in range(0, len(token_ids), self.max_step_tokens):  # within the profile
            logits = self._run(cache, token_ids[start:start + self.max_step_tokens])
        assert logits is not None
        return logits[0]

    def _run(self, cache: KVCache, token_ids: Sequence[int]) -> torch.Tensor:  # [1, vocab]
        m = self.manifest
        total = cache.length + len(token_ids)
        ids = aligned_empty((1, len(token_ids)), self._dtypes[INPUT_IDS], self.device)  # [1, n]
        ids.copy_(torch.tensor([list(token_ids)], dtype=ids.dtype))
        logits = aligned_empty((1, m.vocab_size), self._dtypes[LOGITS], self.device)  # [1, V]
        presents = [aligned_empty((1, m.num_kv_heads, total, m.head_dim), self._kv_dtype,
                                  self.device)  # [1, kv_heads, total, head_dim] each
                    for _ in self._present_names]
        pasts = [aligned(t) for t in cache.tensors]
        self._input(INPUT_IDS, ids)
        for name, tensor in zip(self._past_names, pasts, strict=True):
            self._input(name, tensor)
        self._output(LOGITS, logits)
        for name, tensor in zip(self._present_names, presents, strict=True):
            self._output(name, tensor)
        self._enqueue()
        cache.tensors = presents
        cache.length = total
        return logits

    def _enqueue(self) -> None:
        if self._stream is None:
            ok = self.context.execute_async_v3(0)
        else:
            # Every tensor here was allocated on the caller's stream, which waits for this
            # step before its next work, so none is reused while the engine still reads it.
            caller = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(caller)
            ok = self.context.execute_async_v3(self._stream.cuda_stream)
            caller.wait_stream(self._stream)
        if not ok:
            raise RuntimeError("TensorRT failed to enqueue the draft step")

    def _input(self, name: str, tensor: torch.Tensor) -> None:
        if not self.context.set_input_shape(name, tuple(tensor.shape)):
            raise ValueError(f"{name} shape {tuple(tensor.shape)} is outside the engine's profile")
        self._address(name, tensor)

    def _output(self, name: str, tensor: torch.Tensor) -> None:
        shape = tuple(self.context.get_tensor_shape(name))
        if shape != tuple(tensor.shape):
            raise EngineMismatchError(
                f"the engine makes {name} of shape {shape}, the drafter expects "
                f"{tuple(tensor.shape)}")
        self._address(name, tensor)

    def _address(self, name: str, tensor: torch.Tensor) -> None:
        pointer = tensor.data_ptr() if tensor.numel() else self._scratch.data_ptr()
        if not self.context.set_tensor_address(name, pointer):
            raise RuntimeError(f"TensorRT refused the address of {name}")


def _io_names(modes: dict[str, bool]) -> str:
    inputs = [n for n, is_input in modes.items() if is_input]
    outputs = [n for n, is_input in modes.items() if not is_input]
    return f"(in: {', '.join(inputs)}; out: {', '.join(outputs)})"


def load_tensorrt_engine(
    export_dir: Path,
    manifest: Manifest,
    device: torch.device,
    settings: BuildSettings,
    reference: DraftSource | None = None,
) -> TensorRTEngine:
    """Reuse the stored engine for this GPU, TensorRT and settings, or build, check and
    store one. A stored engine that fails to load is built again.

    ``reference`` (the draft's source model) lets a new engine be checked against
    PyTorch before it is stored; without it the check is skipped.
    """
    key = engine_key(manifest, settings, device)
    path = engine_path(export_dir, key)
    data = read_engine(path, key)
    if data is not None:
        try:
            engine = TensorRTEngine(data, manifest, device, settings)
        except EngineBuildError as exc:
            log.warning("stored TensorRT engine %s is unusable (%s); building it again",
                        path, exc)
        else:
            log.info("reusing TensorRT engine %s", path)
            return engine
    data = build_engine(export_dir / manifest.onnx_file, manifest, settings)
    engine = TensorRTEngine(data, manifest, device, settings)
    if reference is not None:
        step = DraftStep(reference.load_model(manifest.dtype, str(device)))
        result = check_engine(engine, step, manifest.dtype)
        log.info("engine check: %s", result.summary)
        del step
    else:
        log.warning("the draft's source model is not available; the new engine is unchecked")
    if save_engine(path, key, data):
        log.info("stored TensorRT engine %s", path)
    return engine


def engine_device(target: CausalLM) -> torch.device:
    """The GPU the draft engine runs on: the target's, else the first."""
    return target.device if target.device.type == "cuda" else torch.device("cuda", 0)


def load_tensorrt_drafter(
    export_dir: Path,
    manifest: Manifest,
    target: CausalLM,
    tokenizer: Any,
    reference: DraftSource | None = None,
) -> KVDrafter:
    require_tensorrt()
    settings = BuildSettings(max_positions=min(manifest.max_positions, target.max_context))
    engine = load_tensorrt_engine(export_dir, manifest, engine_device(target), settings,
                                  reference)
    log.info("draft %s on %s", manifest.source_spec, engine.runtime)
    return KVDrafter(engine, tokenizer, target)
