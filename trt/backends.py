"""Choosing the engine a draft model runs on: PyTorch, ONNX Runtime or TensorRT.

``load_draft(spec, target, backend, dtype)`` returns the drafter and the backend
actually used. ``auto`` picks TensorRT when it is installed and a GPU is
visible, else ONNX Runtime when a current export of the draft exists, else
PyTorch, and logs why. Naming a backend that cannot run (not installed, no
GPU) raises a ``DraftBackendError`` at start-up; it never falls back silently.
``onnx`` and ``tensorrt`` export the draft on first use (once; later starts
reuse the export while the draft's weights are unchanged).

Specs are those of ``decoding.factory.load_drafter`` (e.g. ``ngram+cache+MODEL``),
where only the model part runs on the backend, plus ``default-truncated:N`` and
export directories (holding ``manifest.json``), which run on ONNX Runtime or
TensorRT without the original model.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from pathlib import Path

from decoding.drafters.base import Drafter
from decoding.drafters.model import ModelDrafter
from decoding.factory import (
    DraftSpecError,
    cheap_only,
    load_drafter,
    load_model_drafter,
    resolve_auto,
    torch_draft_dtype,
)
from decoding.prefix_cache import PrefixCache
from decoding.target import CausalLM
from trt import store
from trt.errors import BackendUnavailableError, DraftBackendError
from trt.manifest import Manifest
from trt.onnx_drafter import (
    CUDA_PROVIDER,
    ELEMENT_TYPES,
    default_providers,
    import_onnxruntime,
    load_export_tokenizer,
    load_onnx_drafter,
    onnxruntime_available,
)
from trt.sources import DraftSource, DraftSourceError
from trt.tensorrt_build import require_tensorrt, tensorrt_unavailable_reason
from trt.tensorrt_drafter import load_tensorrt_drafter

log = logging.getLogger(__name__)


class DraftBackend(StrEnum):
    AUTO = "auto"
    TORCH = "torch"
    ONNX = "onnx"
    TENSORRT = "tensorrt"


BACKENDS = tuple(b.value for b in DraftBackend)


def load_draft(
    spec: str,
    target: CausalLM,
    backend: str = "auto",
    dtype: str = "float32",
    prefix_cache: PrefixCache | None = None,
    *,
    export_root: Path | None = None,
    draft_dtype: str = "auto",
) -> tuple[Drafter | None, str]:
    """The drafter for ``spec`` with its model on ``backend``, and the backend chosen.

    ``spec`` is what ``decoding.factory.load_drafter`` takes (``none``, ``ngram``,
    ``cache``, a draft model, or several joined by ``+``), or ``auto`` (see
    ``decoding.factory.resolve_auto``); only the model part runs on the backend. The
    chosen backend is ``none``/``builtin`` when no model runs. On PyTorch the model runs
    in ``draft_dtype`` (``auto``: ``decoding.factory.torch_draft_dtype``).
    """
    try:
        choice = DraftBackend(backend)
    except ValueError:
        raise DraftBackendError(
            f"unknown draft backend {backend!r}; choose one of {', '.join(BACKENDS)}") from None
    spec = resolve_auto(spec, target, prefix_cache)
    if cheap_only(spec) and choice in (DraftBackend.ONNX, DraftBackend.TENSORRT):
        raise DraftBackendError(
            f"--draft-backend {choice} runs a draft model, but the draft is {spec!r}; "
            "pass a draft model (e.g. --draft default-truncated:4) or --draft-backend auto")
    chosen: list[str] = []

    def model_loader(part: str) -> Drafter:
        drafter, used = load_model_draft(part, target, choice, dtype, export_root=export_root,
                                         draft_dtype=draft_dtype)
        chosen.append(used)
        return drafter

    try:
        drafter = load_drafter(spec, target, dtype, prefix_cache, draft_dtype, model_loader)
    except DraftSpecError as exc:
        raise DraftBackendError(str(exc)) from exc
    if chosen:
        return drafter, chosen[0]
    return drafter, "none" if drafter is None else "builtin"


def load_model_draft(
    spec: str,
    target: CausalLM,
    backend: str = "auto",
    dtype: str = "float32",
    *,
    export_root: Path | None = None,
    draft_dtype: str = "auto",
) -> tuple[Drafter, str]:
    """One draft model (a model directory, ``default-truncated:N``, an export directory or
    a hub id) on ``backend``, and the backend chosen."""
    choice = DraftBackend(backend)
    if store.is_export_dir(spec):
        return _from_export_dir(Path(spec).expanduser(), target, choice, dtype, draft_dtype)
    try:
        source = DraftSource.parse(spec)
    except DraftSourceError as exc:
        if choice in (DraftBackend.TORCH, DraftBackend.AUTO):  # a hub id: PyTorch can load it
            log.info("%s; running the draft on PyTorch", exc)
            return (load_model_drafter(spec, target, dtype, draft_dtype),
                    DraftBackend.TORCH.value)
        raise DraftBackendError(str(exc)) from exc
    if choice is DraftBackend.AUTO:
        choice = _auto(source, dtype, export_root)
    drafter = _load(source, target, choice, dtype, export_root, draft_dtype)
    log.info("draft %s runs on %s", spec, choice.value)
    return drafter, choice.value


def onnx_dtype(dtype: str) -> str:
    """The export dtype ONNX Runtime runs for a requested draft dtype.

    Its CPU provider has no bfloat16 kernels and is slow in float16, so the CPU
    runs float32 exports; the CUDA provider runs float16 when asked for it.
    """
    if dtype == "float16" and CUDA_PROVIDER in default_providers():
        return dtype
    return "float32"


def _auto(source: DraftSource, dtype: str, export_root: Path | None) -> DraftBackend:
    trt_reason = tensorrt_unavailable_reason()
    if trt_reason is None:
        log.info("draft backend auto: TensorRT is installed and a GPU is visible")
        return DraftBackend.TENSORRT
    if not onnxruntime_available():
        log.info("draft backend auto: PyTorch (%s; onnxruntime is not installed)", trt_reason)
        return DraftBackend.TORCH
    found = store.find_export(source, onnx_dtype(dtype), export_root)
    if found.directory is None:
        why = "; ".join(found.rejected) or "no export of this draft yet"
        log.info("draft backend auto: PyTorch (%s; ONNX Runtime: %s -- run `specserve "
                 "export-draft --draft %s` to use it)", trt_reason, why, source.spec)
        return DraftBackend.TORCH
    log.info("draft backend auto: ONNX Runtime (%s; export in %s)", trt_reason, found.directory)
    return DraftBackend.ONNX


def _load(source: DraftSource, target: CausalLM, choice: DraftBackend, dtype: str,
          export_root: Path | None, draft_dtype: str = "auto") -> Drafter:
    if choice is DraftBackend.TORCH:
        if source.distilled:  # shares the running target's embedding
            return load_model_drafter(str(source.path), target, dtype, draft_dtype)
        run_dtype = torch_draft_dtype(dtype, target.device, draft_dtype)
        model = source.load_causal_lm(run_dtype, str(target.device))
        return ModelDrafter(model, target)
    if choice is DraftBackend.ONNX:
        import_onnxruntime()  # a clear error before any export work
        export_dir, manifest = store.ensure_export(source, onnx_dtype(dtype), export_root)
        return load_onnx_drafter(export_dir, target, manifest)
    require_tensorrt()
    # A bfloat16 export cannot be checked with ONNX Runtime; the engine build checks it.
    check = dtype in ELEMENT_TYPES
    export_dir, manifest = store.ensure_export(source, dtype, export_root, check=check)
    return load_tensorrt_drafter(export_dir, manifest, target, source.load_tokenizer(),
                                 reference=source)


def _from_export_dir(export_dir: Path, target: CausalLM, choice: DraftBackend, dtype: str,
                     draft_dtype: str = "auto") -> tuple[Drafter, str]:
    manifest = Manifest.load(export_dir)
    if choice is DraftBackend.AUTO:
        if tensorrt_unavailable_reason() is None:
            choice = DraftBackend.TENSORRT
        elif onnxruntime_available() and manifest.dtype in ELEMENT_TYPES:
            choice = DraftBackend.ONNX
        else:
            choice = DraftBackend.TORCH
    if choice is DraftBackend.TORCH:
        try:
            source = DraftSource.parse(manifest.source_spec)
        except DraftSourceError as exc:
            raise BackendUnavailableError(
                f"{export_dir} is an exported draft; PyTorch needs its source model "
                f"{manifest.source_spec!r}, which is not available: {exc}") from exc
        return _load(source, target, choice, dtype, None, draft_dtype), choice.value
    if choice is DraftBackend.ONNX:
        drafter: Drafter = load_onnx_drafter(export_dir, target, manifest)
    else:
        require_tensorrt()
        drafter = load_tensorrt_drafter(export_dir, manifest, target,
                                        load_export_tokenizer(export_dir), reference=None)
    log.info("draft %s runs on %s", export_dir, choice.value)
    return drafter, choice.value
