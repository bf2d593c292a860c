"""The exported step on ONNX's reference evaluator: slow, but it runs every dtype.

ONNX Runtime's CPU provider has no bfloat16 kernels, so a bfloat16 export (the
TensorRT engine's input for a bfloat16 server) is checked here instead, on the
CPU: the graph is executed as written, in bfloat16, by ``onnx.reference``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trt.kv_drafter import KVCache
from trt.manifest import INPUT_IDS, Manifest

# torch dtype -> (the integer view that shares its bits, numpy dtype name)
_BITS = {torch.bfloat16: (torch.int16, "bfloat16"), torch.float16: (torch.float16, "float16"),
         torch.float32: (torch.float32, "float32")}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as numpy (bfloat16 through ml_dtypes, bit for bit)."""
    import ml_dtypes

    bits, name = _BITS[tensor.dtype]
    array = tensor.detach().cpu().contiguous().view(bits).numpy()
    return array.view(ml_dtypes.bfloat16) if name == "bfloat16" else array


def from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)


class ReferenceEngine:
    """Runs the exported decoding step with ``onnx.reference`` (a ``StepEngine``)."""

    def __init__(self, export_dir: Path, manifest: Manifest | None = None) -> None:
        import onnx
        from onnx.reference import ReferenceEvaluator

        self.manifest = manifest or Manifest.load(export_dir)
        model = onnx.load(str(export_dir / self.manifest.onnx_file))
        self._evaluator: Any = ReferenceEvaluator(model)
        self._dtype = TORCH_DTYPES[self.manifest.dtype]
        self.runtime = f"onnx {onnx.__version__} reference evaluator (CPU)"
        self.vocab_size = self.manifest.vocab_size

    def empty_cache(self) -> KVCache:
        m = self.manifest
        shape = (1, m.num_kv_heads, 0, m.head_dim)
        return KVCache([torch.empty(shape, dtype=self._dtype) for _ in m.past_names])

    def step(self, cache: KVCache, token_ids: Sequence[int]) -> torch.Tensor:  # [vocab]
        m = self.manifest
        feeds = {INPUT_IDS: np.array([list(token_ids)], dtype=np.int64)}  # [1, n]
        feeds.update({name: to_numpy(t) for name, t in zip(m.past_names, cache.tensors,
                                                            strict=True)})
        logits, *presents = self._evaluator.run(None, feeds)
        cache.tensors = [from_numpy(p, self._dtype) for p in presents]
        cache.length += len(token_ids)
        return from_numpy(logits, self._dtype)[0]
