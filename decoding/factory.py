"""Building the target and drafters from names on the command line or in settings."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from decoding import draft_format as distilled
from decoding import model_store
from decoding.batched import BatchedLM
from decoding.drafters.base import Drafter
from decoding.drafters.combined import CombinedDrafter
from decoding.drafters.continuation import ContinuationDrafter
from decoding.drafters.model import ModelDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.prefix_cache import PrefixCache
from decoding.target import CausalLM

log = logging.getLogger(__name__)

NO_DRAFT = "none"
NGRAM = "ngram"
CACHE = "cache"
AUTO = "auto"  # lookup, plus the shipped draft model where it fits the target
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "int8", "int4")  # int8/int4: quantized
QUANTIZE = ("auto", "none", "int8", "int4")
# precisions a benchmark names a target by: (dtype, quantize)
PRECISIONS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"),
              "int8": ("bfloat16", "int8"), "int4": ("bfloat16", "int4"),
              "gguf": ("bfloat16", "auto")}
CHEAP_DRAFTS = frozenset({NO_DRAFT, NGRAM, CACHE})  # drafters that run no model


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
    return BatchedLM.load(path, dtype=dtype, device=device, quantize=quantize, kernels=kernels,
                          int8_activations=int8_activations)


def target_precision(target: CausalLM) -> str:
    """What the target's matrices hold: float32, bfloat16, int8, int4 or gguf-<types>."""
    return str(getattr(target, "weights_format", str(target.dtype).removeprefix("torch.")))


class DraftSpecError(ValueError):
    """A draft spec that names no valid combination of drafters."""


ModelLoader = Callable[[str], Drafter]  # a draft spec's model part -> its drafter


def load_drafter(
    spec: str,
    target: CausalLM,
    dtype: str = "float32",
    prefix_cache: PrefixCache | None = None,
    draft_dtype: str = "auto",
    model_loader: ModelLoader | None = None,
) -> Drafter | None:
    """Parse a draft spec: ``none``, ``ngram``, ``cache``, a model (path or hub id),
    or several joined by ``+`` (e.g. ``ngram+cache``): the longest lookup proposal
    wins, and a model draft runs when lookup found nothing or has lately been right
    less often than the model (``CombinedDrafter``); or ``auto`` (``auto_draft``).
    The model part is loaded by ``model_loader`` (default: on PyTorch, in
    ``draft_dtype``; see ``torch_draft_dtype``). This is the one parser of draft specs."""
    spec = resolve_auto(spec, target, prefix_cache)
    parts = draft_parts(spec)
    if not parts or parts == [NO_DRAFT]:
        return None
    if NO_DRAFT in parts:
        raise DraftSpecError("'none' cannot be combined with other drafters")
    models = [part for part in parts if part not in CHEAP_DRAFTS]
    if len(models) > 1:
        raise DraftSpecError(f"draft spec {spec!r} names more than one draft model")
    if CACHE in parts and prefix_cache is None:
        raise DraftSpecError("the 'cache' drafter needs the prefix cache to be enabled")
    cheap: list[Drafter] = [NgramDrafter() if part == NGRAM
                            else ContinuationDrafter(prefix_cache, target.vocab_size)  # type: ignore[arg-type]
                            for part in parts if part in (NGRAM, CACHE)]
    model: Drafter | None = None
    if models:
        load = model_loader or (lambda part: load_model_drafter(part, target, dtype, draft_dtype))
        model = load(models[0])
        model.name = models[0]  # the name the user typed: requests and metrics use it too
    if len(cheap) + (model is not None) == 1:
        return cheap[0] if cheap else model
    return CombinedDrafter(cheap, model)


def cheap_only(spec: str) -> bool:
    """Whether ``spec`` runs no draft model (only lookup sources, or nothing)."""
    return all(part in CHEAP_DRAFTS for part in draft_parts(spec))


class DraftLoader(Protocol):
    """Loads the default drafter of a server: ``(drafter or None, backend it runs on)``.
    The command line passes the one that can run draft models on ONNX Runtime and
    TensorRT; ``torch_draft_loader`` runs them on PyTorch."""

    def __call__(self, spec: str, target: CausalLM, backend: str, dtype: str,
                 prefix_cache: PrefixCache | None, *, draft_dtype: str = "auto",
                 ) -> tuple[Drafter | None, str]: ...


def torch_draft_loader(spec: str, target: CausalLM, backend: str, dtype: str,
                       prefix_cache: PrefixCache | None, *, draft_dtype: str = "auto",
                       ) -> tuple[Drafter | None, str]:
    """A ``DraftLoader`` whose draft models run on PyTorch (``backend`` auto or torch)."""
    if backend not in ("auto", "torch"):
        raise DraftSpecError(f"draft backend {backend!r} is not available in this server")
    spec = resolve_auto(spec, target, prefix_cache)
    drafter = load_drafter(spec, target, dtype, prefix_cache, draft_dtype)
    if drafter is None:
        return None, "none"
    return drafter, "builtin" if cheap_only(spec) else "torch"


def draft_parts(spec: str) -> list[str]:
    """The drafters a spec joins with ``+`` (blank parts ignored)."""
    return [p.strip() for p in spec.split("+") if p.strip()]


def resolve_auto(spec: str, target: CausalLM, prefix_cache: PrefixCache | None) -> str:
    """``spec``, with ``auto`` replaced by what it means for ``target``."""
    if spec != AUTO:
        return spec
    resolved = auto_draft(target, prefix_cache=prefix_cache is not None)
    log.info("draft auto: %s", resolved)
    return resolved


def auto_draft(target: CausalLM, prefix_cache: bool) -> str:
    """What ``auto`` means for ``target``: n-gram lookup and (with a prefix cache)
    continuation drafts, plus the draft shipped for the default model when ``target``
    is the model it was made for (a draft refuses any other)."""
    parts = [NGRAM, *([CACHE] if prefix_cache else [])]
    if distilled.default_draft_fits(target):
        parts.append(distilled.DEFAULT_DRAFT)
    return "+".join(parts)


def load_model_drafter(spec: str, target: CausalLM, dtype: str = "float32",
                       draft_dtype: str = "auto") -> ModelDrafter:
    """A draft model: a distilled draft directory (or ``default-draft``, the one shipped for
    the default model), a local model directory, or a hub id; on PyTorch, in
    ``draft_dtype`` (``auto``: ``torch_draft_dtype``)."""
    if draft_dtype == "auto" and quantized_target(target):
        draft_dtype = "int4"  # a draft beside a quantized target is quantized too
    run_dtype = torch_draft_dtype(dtype, target.device, draft_dtype)
    quantize = run_dtype if run_dtype in ("int8", "int4") else "none"
    if quantize != "none":
        run_dtype = "bfloat16"
    directory = distilled.resolve_draft_dir(spec)
    if directory is not None:
        log.info("loading distilled draft %s (%s, quantize %s)", directory, run_dtype, quantize)
        return ModelDrafter(distilled.load_causal_lm(directory, target, run_dtype, quantize),
                            target)
    path = model_store.resolve(spec)
    log.info("loading draft model %s (%s, quantize %s)", path, run_dtype, quantize)
    model = BatchedLM.load(path, dtype=run_dtype, device=str(target.device),
                           quantize=quantize)
    return ModelDrafter(model, target)


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
