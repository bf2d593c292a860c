"""Loading a target by name, and the precisions it and a draft beside it run in."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from runtime.files import model_store
from runtime.loaders import gguf_weights
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM

log = logging.getLogger(__name__)

DRAFT_DTYPES = ("auto", "float32", "bfloat16", "int8", "int4")  # int8/int4: quantized
QUANTIZE = ("auto", "none", "int8", "int4")
# precisions a benchmark names a target by: (dtype, quantize)
PRECISIONS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"),
              "int8": ("bfloat16", "int8"), "int4": ("bfloat16", "int4"),
              "gguf": ("bfloat16", "auto")}


def load_target(spec: str = "default", dtype: str = "float32", device: str = "cpu",
                quantize: str = "none", kernels: str = "auto",
                int8_activations: bool = True) -> CausalLM:
    """The target ``spec`` names, in ``dtype``; ``quantize``: ``auto`` serves a GGUF file's
    own weights (for the default model, its GGUF file: int4 with bfloat16 activations);
    ``none`` a model directory as it is (the default model dequantized to ``dtype``);
    ``int8``/``int4`` a model directory quantized at load. ``kernels``: what runs the
    elementwise work and attention (``BatchedLM.use_kernels``); ``int8_activations``: 4-bit
    and Q8_0 matrices multiply int8-quantized activations where the native kernels can
    (``BatchedLM.load``)."""
    if quantize not in QUANTIZE:
        raise ValueError(f"unknown quantization {quantize!r}; choose one of {list(QUANTIZE)}")
    if spec in model_store.DEFAULT_ALIASES and quantize == "auto" and device == "cpu":
        path = str(model_store.default_gguf())
    else:
        path = model_store.resolve(spec)
    log.info("loading target %s (%s, quantize %s, %s)", path, dtype, quantize, device)
    return load_model(path, dtype=dtype, device=device, quantize=quantize, kernels=kernels,
                      int8_activations=int8_activations)


def load_model(path: str, dtype: str = "float32", device: str = "cpu",
               quantize: str = "auto", kernels: str = "auto",
               int8_activations: bool = True) -> CausalLM:
    """The runner for a model directory (``BatchedLM.load``) or a GGUF file
    (``gguf_weights.load``), by the path's kind."""
    if str(path).endswith(".gguf"):
        return gguf_weights.load(path, dtype, device, quantize, kernels, int8_activations)
    return BatchedLM.load(path, dtype=dtype, device=device, quantize=quantize, kernels=kernels,
                          int8_activations=int8_activations)


def target_precision(target: CausalLM) -> str:
    """What the target's matrices hold: float32, bfloat16, int8, int4 or gguf-<types>."""
    return str(getattr(target, "weights_format", str(target.dtype).removeprefix("torch.")))


def torch_draft_dtype(target_dtype: str, device: torch.device | str,
                      requested: str = "auto") -> str:
    """The dtype a PyTorch draft model runs in: ``requested``, or for ``auto`` the
    target's, except that beside a float32 target on a CPU with native bfloat16
    arithmetic (AVX512-BF16 or AMX) the draft runs in bfloat16.

    A draft step is mostly memory traffic, so half the bytes make it much faster
    (docs/performance.md); output is unaffected: the target verifies every token in
    its own dtype."""
    if requested not in DRAFT_DTYPES:
        raise ValueError(f"unknown draft dtype {requested!r}; choose one of {list(DRAFT_DTYPES)}")
    if requested != "auto":
        return requested
    if target_dtype == "float32" and torch.device(device).type == "cpu" and cpu_has_bf16():
        return "bfloat16"
    return target_dtype


def quantized_target(target: CausalLM) -> bool:
    return target_precision(target) not in ("float32", "bfloat16", "float16")


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU does bfloat16 products in hardware (Linux: its ``avx512_bf16`` or
    ``amx_bf16`` flag) and PyTorch uses them; elsewhere the answer is no, because an
    emulated bfloat16 draft can be slower than a float32 one."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except (AttributeError, RuntimeError, OSError):  # no oneDNN; not Linux
        return False
    flags = {flag for line in text.splitlines() if line.startswith("flags")
             for flag in line.split(":", 1)[-1].split()}
    return bool(flags & {"avx512_bf16", "amx_bf16"})
