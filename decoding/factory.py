"""Building the target and drafters from names on the command line or in settings."""

from __future__ import annotations

import logging

from decoding import model_store
from decoding.drafters.base import Drafter
from decoding.drafters.model import ModelDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.target import CausalLM

log = logging.getLogger(__name__)

NO_DRAFT = "none"
NGRAM = "ngram"


def load_target(spec: str = "default", dtype: str = "float32", device: str = "cpu") -> CausalLM:
    path = model_store.resolve(spec)
    log.info("loading target %s (%s, %s)", path, dtype, device)
    return CausalLM.load(path, dtype=dtype, device=device)


def load_drafter(spec: str, target: CausalLM, dtype: str = "float32") -> Drafter | None:
    """``none``, ``ngram``, or a path/hub id of a causal LM sharing the target's tokenizer."""
    if spec == NO_DRAFT:
        return None
    if spec == NGRAM:
        return NgramDrafter()
    path = model_store.resolve(spec)
    log.info("loading draft model %s", path)
    model = CausalLM.load(path, dtype=dtype, device=str(target.device))
    return ModelDrafter(model, target)
