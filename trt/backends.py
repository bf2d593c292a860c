"""Choosing the engine a draft model runs on: PyTorch, ONNX Runtime or TensorRT.

``load_draft(spec, target, backend, dtype)`` returns the drafter and the backend
actually used. ``auto`` tries TensorRT when it is installed and a GPU is
visible, then ONNX Runtime when a current export of the draft exists, then
PyTorch: a backend that cannot run, or fails while loading, is passed over with
the reason logged and kept in the returned name, e.g. ``torch (tensorrt: no CUDA
GPU is visible to PyTorch; onnx: no export of this draft yet)``, which the
server shows in ``/v1/models``. Naming a backend that cannot run (not installed,
no GPU) raises a ``DraftBackendError`` at start-up; it never falls back.
``onnx`` and ``tensorrt`` export the draft on first use (once; later starts
reuse the export while the draft's weights are unchanged).

Specs are those of ``wiring.drafts.load_drafter`` (e.g. ``ngram+cache+MODEL``),
where only the model part runs on the backend, plus ``default-truncated:N`` and
export directories (holding ``manifest.json``), which run on ONNX Runtime or
TensorRT without the original model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from enum import StrEnum
from pathlib import Path

from decoding.drafter import Drafter
from decoding.prefix_cache import PrefixCache
from drafters.model import ModelDrafter
from runtime.loaders.loading import torch_draft_dtype
from runtime.runner.causal_lm import CausalLM
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
from wiring.drafts import (
    DraftSpecError,
    cheap_only,
    load_drafter,
    load_model_drafter,
    resolve_auto,
)

log = logging.getLogger(__name__)


class DraftBackend(StrEnum):
    AUTO = "auto"
    TORCH = "torch"
    ONNX = "onnx"
    TENSORRT = "tensorrt"


BACKENDS = tuple(b.value for b in DraftBackend)
REASON_CHARS = 200  # a failure's message is cut to this in the backend's name

# A backend auto may use: its name, why it cannot run (None: it can; asked only when
# the options before it failed), and its loader.
Option = tuple[DraftBackend, Callable[[], str | None], Callable[[], Drafter]]


def backend_name(chosen: str) -> str:
    """The bare backend of a name ``load_draft`` returned (``torch (tensorrt: ...)``)."""
    return chosen.split(" ", 1)[0]


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

    ``spec`` is what ``wiring.drafts.load_drafter`` takes (``none``, ``ngram``,
    ``cache``, a draft model, or several joined by ``+``), or ``auto`` (see
    ``wiring.drafts.resolve_auto``); only the model part runs on the backend. The
    chosen backend is ``none``/``builtin`` when no model runs. On PyTorch the model runs
    in ``draft_dtype`` (``auto``: ``runtime.loaders.loading.torch_draft_dtype``).
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
        return _first_that_loads(_auto_options(source, target, dtype, export_root,
                                               draft_dtype))
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


def _auto_options(source: DraftSource, target: CausalLM, dtype: str,
                  export_root: Path | None, draft_dtype: str) -> list[Option]:
    def load(choice: DraftBackend) -> Callable[[], Drafter]:
        return lambda: _load(source, target, choice, dtype, export_root, draft_dtype)

    return [(DraftBackend.TENSORRT, tensorrt_unavailable_reason, load(DraftBackend.TENSORRT)),
            (DraftBackend.ONNX, lambda: _onnx_unavailable_reason(source, dtype, export_root),
             load(DraftBackend.ONNX)),
            (DraftBackend.TORCH, _runs_anywhere, load(DraftBackend.TORCH))]


def _runs_anywhere() -> None:
    return None


def _onnx_unavailable_reason(source: DraftSource, dtype: str, export_root: Path | None
                             ) -> str | None:
    if not onnxruntime_available():
        return "onnxruntime is not installed"
    found = store.find_export(source, onnx_dtype(dtype), export_root)
    if found.directory is None:
        log.info("`specserve export-draft --draft %s` makes an export ONNX Runtime can run",
                 source.spec)
        return "; ".join(found.rejected) or "no export of this draft yet"
    return None


def _first_that_loads(options: Sequence[Option]) -> tuple[Drafter, str]:
    """The drafter of the first option that can run and loads, named with why every
    option before it was passed over; the last option's failure is raised."""
    passed: list[str] = []
    for i, (backend, reason, load) in enumerate(options):
        unavailable = reason()
        if unavailable is None:
            try:
                drafter = load()
            except Exception as exc:  # auto serves on the next backend whatever this raised
                if i == len(options) - 1:
                    raise
                log.warning("draft backend auto: %s failed, trying the next backend: %s",
                            backend.value, exc, exc_info=True)
                unavailable = "failed: " + _one_line(exc)
            else:
                name = f"{backend.value} ({'; '.join(passed)})" if passed else backend.value
                log.info("draft backend auto: %s", name)
                return drafter, name
        passed.append(f"{backend.value}: {unavailable}")
    raise BackendUnavailableError("no draft backend can run this draft: " + "; ".join(passed))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 3] + "..."


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
    # A bfloat16 export is checked with the engine, on the GPU (its CPU check is slow).
    check = dtype in ELEMENT_TYPES
    export_dir, manifest = store.ensure_export(source, dtype, export_root, check=check)
    return load_tensorrt_drafter(export_dir, manifest, target, source.load_tokenizer(),
                                 reference=source)


def _from_export_dir(export_dir: Path, target: CausalLM, choice: DraftBackend, dtype: str,
                     draft_dtype: str = "auto") -> tuple[Drafter, str]:
    manifest = Manifest.load(export_dir)
    loaders: dict[DraftBackend, Callable[[], Drafter]] = {
        DraftBackend.TENSORRT: lambda: _export_on_tensorrt(export_dir, manifest, target),
        DraftBackend.ONNX: lambda: load_onnx_drafter(export_dir, target, manifest),
        DraftBackend.TORCH: lambda: _export_source_on_torch(export_dir, manifest, target,
                                                            dtype, draft_dtype),
    }
    if choice is DraftBackend.AUTO:
        def onnx_reason() -> str | None:
            if not onnxruntime_available():
                return "onnxruntime is not installed"
            if manifest.dtype not in ELEMENT_TYPES:
                return f"it cannot run the {manifest.dtype} export"
            return None

        return _first_that_loads([
            (DraftBackend.TENSORRT, tensorrt_unavailable_reason, loaders[DraftBackend.TENSORRT]),
            (DraftBackend.ONNX, onnx_reason, loaders[DraftBackend.ONNX]),
            (DraftBackend.TORCH, _runs_anywhere, loaders[DraftBackend.TORCH]),
        ])
    drafter = loaders[choice]()
    log.info("draft %s runs on %s", export_dir, choice.value)
    return drafter, choice.value


def _export_on_tensorrt(export_dir: Path, manifest: Manifest, target: CausalLM) -> Drafter:
    require_tensorrt()
    return load_tensorrt_drafter(export_dir, manifest, target,
                                 load_export_tokenizer(export_dir), reference=None)


def _export_source_on_torch(export_dir: Path, manifest: Manifest, target: CausalLM,
                            dtype: str, draft_dtype: str) -> Drafter:
    try:
        source = DraftSource.parse(manifest.source_spec)
    except DraftSourceError as exc:
        raise BackendUnavailableError(
            f"{export_dir} is an exported draft; PyTorch needs its source model "
            f"{manifest.source_spec!r}, which is not available: {exc}") from exc
    return _load(source, target, DraftBackend.TORCH, dtype, None, draft_dtype)
