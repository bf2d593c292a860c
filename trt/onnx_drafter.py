"""The exported draft on ONNX Runtime (CPU; CUDA when that provider is installed).

The KV cache lives in torch tensors that ONNX Runtime reads and writes in place
through IO binding: no numpy conversions, no output copies, and the logits come
back as a tensor the sampling code uses directly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from runtime.runner.causal_lm import CausalLM
from trt.errors import BackendUnavailableError, MissingDependencyError
from trt.kv_drafter import KVCache, KVDrafter
from trt.manifest import INPUT_IDS, LOGITS, Manifest

log = logging.getLogger(__name__)

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
# ONNX Runtime element types for the dtypes its CPU and CUDA providers run.
ELEMENT_TYPES: dict[str, tuple[type, torch.dtype]] = {
    "float32": (np.float32, torch.float32),
    "float16": (np.float16, torch.float16),
}


def import_onnxruntime() -> ModuleType:
    try:
        import onnxruntime
    except ImportError as exc:
        raise MissingDependencyError(
            "the ONNX draft backend needs onnxruntime, which is not installed: "
            "pip install 'specserve[onnx]' (or use --draft-backend torch)") from exc
    return onnxruntime


def onnxruntime_available() -> bool:
    try:
        import_onnxruntime()
    except MissingDependencyError:
        return False
    return True


def default_providers() -> list[str]:
    """CUDA first when both ONNX Runtime and torch can use a GPU, then the CPU."""
    ort = import_onnxruntime()
    if CUDA_PROVIDER in ort.get_available_providers() and torch.cuda.is_available():
        return [CUDA_PROVIDER, CPU_PROVIDER]
    return [CPU_PROVIDER]


class OrtEngine:
    """Runs the exported decoding step with ONNX Runtime (a ``StepEngine``)."""

    def __init__(
        self,
        export_dir: Path,
        manifest: Manifest | None = None,
        providers: Sequence[str] | None = None,
        threads: int | None = None,
    ) -> None:
        ort = import_onnxruntime()
        self.manifest = manifest or Manifest.load(export_dir)
        if self.manifest.dtype not in ELEMENT_TYPES:
            raise BackendUnavailableError(
                f"ONNX Runtime cannot run the {self.manifest.dtype} export in {export_dir}; "
                f"export it as one of {sorted(ELEMENT_TYPES)} (or use TensorRT for bfloat16)")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.log_severity_level = 3  # errors only
        # The target runs on the same cores between draft steps: idle ORT threads must
        # sleep, not spin (spinning slows the target's forward pass several times over).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session: Any = ort.InferenceSession(
            str(export_dir / self.manifest.onnx_file), options,
            providers=list(providers or default_providers()))
        provider = self.session.get_providers()[0]
        self.device = torch.device("cuda" if provider == CUDA_PROVIDER else "cpu")
        self._ort_device = self.device.type
        self.runtime = f"onnxruntime {ort.__version__} ({provider})"
        self.vocab_size = self.manifest.vocab_size
        self._element_type, self._dtype = ELEMENT_TYPES[self.manifest.dtype]
        self._past_names = self.manifest.past_names
        self._present_names = self.manifest.present_names

    def empty_cache(self) -> KVCache:
        m = self.manifest
        shape = (1, m.num_kv_heads, 0, m.head_dim)
        return KVCache([torch.empty(shape, dtype=self._dtype, device=self.device)
                        for _ in self._past_names])

    def step(self, cache: KVCache, token_ids: Sequence[int]) -> torch.Tensor:  # [vocab]
        m = self.manifest
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        total = cache.length + ids.shape[1]
        logits = torch.empty((1, m.vocab_size), dtype=self._dtype, device=self.device)  # [1, V]
        presents = [  # [1, kv_heads, total, head_dim] each
            torch.empty((1, m.num_kv_heads, total, m.head_dim), dtype=self._dtype,
                        device=self.device)
            for _ in self._present_names
        ]
        binding = self.session.io_binding()
        self._bind(binding.bind_input, INPUT_IDS, ids, np.int64)
        for name, tensor in zip(self._past_names, cache.tensors, strict=True):
            self._bind(binding.bind_input, name, tensor, self._element_type)
        self._bind(binding.bind_output, LOGITS, logits, self._element_type)
        for name, tensor in zip(self._present_names, presents, strict=True):
            self._bind(binding.bind_output, name, tensor, self._element_type)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # inputs written by torch
        self.session.run_with_iobinding(binding)
        cache.tensors = presents
        cache.length = total
        return logits[0]

    def _bind(self, bind: Any, name: str, tensor: torch.Tensor, element_type: type) -> None:
        bind(name, self._ort_device, self.device.index or 0, element_type,
             list(tensor.shape), tensor.data_ptr())


def load_export_tokenizer(export_dir: Path) -> Any:
    """The draft's tokenizer, saved with the export (to check it against the target's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(export_dir)


def load_onnx_drafter(
    export_dir: Path,
    target: CausalLM | None,
    manifest: Manifest | None = None,
    threads: int | None = None,
) -> KVDrafter:
    engine = OrtEngine(export_dir, manifest, threads=threads)
    log.info("draft %s on %s", engine.manifest.source_spec, engine.runtime)
    return KVDrafter(engine, load_export_tokenizer(export_dir), target)
