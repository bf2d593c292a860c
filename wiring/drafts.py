"""Building the target and drafters from names on the command line or in settings."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from decoding.drafter import Drafter
from decoding.prefix_cache import PrefixCache
from drafters.combined import CombinedDrafter
from drafters.continuation import ContinuationDrafter
from drafters.feature import FeatureDrafter
from drafters.model import ModelDrafter
from drafters.ngram import NgramDrafter
from runtime.drafts import draft_format as distilled
from runtime.drafts import feature_draft
from runtime.drafts.draft_choice import choice_path_for, read_choice
from runtime.files import model_store
from runtime.loaders.loading import load_model, quantized_target, torch_draft_dtype
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM

log = logging.getLogger(__name__)

NO_DRAFT = "none"
NGRAM = "ngram"
CACHE = "cache"
AUTO = "auto"  # the mix measured fastest for the target, else lookup (auto_choice)
CHEAP_DRAFTS = frozenset({NO_DRAFT, NGRAM, CACHE})  # drafters that run no model


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
    cheap: list[Drafter] = []
    for part in parts:
        if part == NGRAM:
            cheap.append(NgramDrafter())
        elif part == CACHE and prefix_cache is not None:  # (None refused above)
            cheap.append(ContinuationDrafter(prefix_cache, target.vocab_size))
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
    resolved, reason = auto_choice(target, prefix_cache=prefix_cache is not None)
    log.info("draft auto: %s (%s)", resolved, reason)
    return resolved


def auto_draft(target: CausalLM, prefix_cache: bool) -> str:
    """What ``auto`` means for ``target`` (``auto_choice``)."""
    return auto_choice(target, prefix_cache)[0]


def auto_choice(target: CausalLM, prefix_cache: bool) -> tuple[str, str]:
    """What ``auto`` means for ``target``, and why: the mix measured fastest for it where
    a measurement is stored (``runtime.drafts.draft_choice``), else n-gram lookup plus the draft
    shipped for the default model when ``target`` is the model it was made for (a draft
    refuses any other); with a prefix cache, continuation drafts join either."""
    fits = distilled.default_draft_fits(target)
    mine = choice_path_for(target.name)
    measured = read_choice() if fits else read_choice(mine) if mine.is_file() else None
    if measured is not None:
        parts = draft_parts(measured.spec) if measured.spec != NO_DRAFT else []
        reason = measured.reason()
    elif fits:
        parts = [NGRAM, distilled.DEFAULT_DRAFT]
        reason = "lookup and the draft made for this target; no measured choice is stored"
    else:
        parts = [NGRAM]
        reason = "lookup; no draft was made for this target"
    if prefix_cache:
        parts.insert(parts.index(NGRAM) + 1 if NGRAM in parts else 0, CACHE)
    return "+".join(parts) or NO_DRAFT, reason


def load_model_drafter(spec: str, target: CausalLM, dtype: str = "float32",
                       draft_dtype: str = "auto") -> ModelDrafter | FeatureDrafter:
    """A draft model: a feature draft directory (or ``feature-draft``, the one shipped for
    the default model), a distilled draft directory (or ``default-draft``), a model of the
    catalogue, a GGUF file (``gguf_draft``), a local model directory, or a hub id; on
    PyTorch, in ``draft_dtype`` (``auto``: ``torch_draft_dtype``)."""
    requested = draft_dtype
    if draft_dtype == "auto" and quantized_target(target):
        draft_dtype = "int4"  # a draft beside a quantized target is quantized too
    run_dtype = torch_draft_dtype(dtype, target.device, draft_dtype)
    quantize = run_dtype if run_dtype in ("int8", "int4") else "none"
    if quantize != "none":
        run_dtype = "bfloat16"
    features = feature_draft.resolve_feature_draft_dir(spec)
    if features is not None:
        if not target.capabilities.features or not isinstance(target, BatchedLM):
            raise DraftSpecError(f"the feature draft {spec!r} needs a target that gives its "
                                 "hidden states (one the batched runner serves)")
        log.info("loading feature draft %s (%s, quantize %s)", features, run_dtype, quantize)
        return FeatureDrafter(feature_draft.load(features, target, run_dtype, quantize), target)
    directory = distilled.resolve_draft_dir(spec)
    if directory is not None:
        log.info("loading distilled draft %s (%s, quantize %s)", directory, run_dtype, quantize)
        return ModelDrafter(distilled.load_causal_lm(directory, target, run_dtype, quantize),
                            target)
    path = model_store.resolve(spec)
    if path.endswith(".gguf"):
        return ModelDrafter(gguf_draft(path, target, dtype, requested), target)
    log.info("loading draft model %s (%s, quantize %s)", path, run_dtype, quantize)
    model = BatchedLM.load(path, dtype=run_dtype, device=str(target.device),
                           quantize=quantize)
    return ModelDrafter(model, target)


def gguf_draft(path: str, target: CausalLM, dtype: str = "float32",
               draft_dtype: str = "auto") -> CausalLM:
    """A GGUF file as a draft model, by the runner a target of that file gets
    (``runtime.loaders.loading.load_model``): on a CPU with ``draft_dtype`` auto, the file's own
    quantized weights; else the file dequantized to ``draft_dtype`` (``torch_draft_dtype``).
    int8 and int4 are refused: the file is quantized already."""
    if draft_dtype in ("int8", "int4"):
        raise DraftSpecError(f"--draft-dtype {draft_dtype} quantizes a model directory; the "
                             f"draft {path} is a GGUF file, quantized already (use auto for "
                             "its own weights)")
    device = str(target.device)
    if draft_dtype == "auto" and target.device.type == "cpu":
        log.info("loading draft model %s (its own weights)", path)
        return load_model(path, device=device, quantize="auto")
    run_dtype = torch_draft_dtype(dtype, target.device, draft_dtype)
    log.info("loading draft model %s (dequantized to %s)", path, run_dtype)
    return load_model(path, dtype=run_dtype, device=device, quantize="none")
