"""Which model a draft spec names, how to load it, and a fingerprint of its weights.

A draft spec is a local Hugging Face model directory, a ``specserve distill``
draft directory (or ``default-draft``), ``default``, or a model with
``-truncated:N`` appended, which keeps only the model's first N decoder layers
(``default-truncated:4`` is the default model cut to 4 layers: a cheap draft
that needs no training and shares the target's tokenizer).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from runtime.drafts import draft_format as distilled
from runtime.files import model_store
from runtime.models.checkpoints import DTYPES
from runtime.runner.causal_lm import CausalLM, TransformersLM

log = logging.getLogger(__name__)

TRUNCATED = re.compile(r"^(?P<base>.+)-truncated:(?P<layers>\d+)$")
WEIGHT_SUFFIXES = (".safetensors", ".bin")
_CHUNK = 1 << 24


class DraftSourceError(ValueError):
    """The draft spec does not name a local model that can be exported."""


@dataclass(frozen=True)
class DraftSource:
    """A local causal LM, optionally truncated to its first ``layers`` decoder layers."""

    spec: str
    path: Path
    layers: int | None = None

    @classmethod
    def parse(cls, spec: str) -> DraftSource:
        match = TRUNCATED.match(spec)
        base, layers = (match["base"], int(match["layers"])) if match else (spec, None)
        if layers is not None and layers < 1:
            raise DraftSourceError(f"{spec!r}: keep at least one layer")
        if layers is None and (found := distilled.resolve_draft_dir(base)) is not None:
            return cls(spec=spec, path=found.resolve())
        path = Path(model_store.resolve(base)).expanduser()
        if path.suffix == ".gguf":
            raise DraftSourceError(f"{spec!r} is a GGUF file ({path.name}); exported drafts "
                                   "start from a model directory")
        if not (path / "config.json").is_file():
            raise DraftSourceError(
                f"{spec!r} is not a local model directory; exported drafts need the weights "
                "on disk (download the model first, then pass its directory)")
        return cls(spec=spec, path=path.resolve(), layers=layers)

    @property
    def distilled(self) -> bool:
        """A ``specserve distill`` draft: only what the target lacks, loaded with the target."""
        return distilled.is_draft_dir(self.path)

    @property
    def key(self) -> str:
        """A short stable name for this source's location (not its contents)."""
        ident = f"{self.path}|{self.layers or 'all'}"
        return hashlib.sha256(ident.encode()).hexdigest()[:16]

    @cached_property
    def fingerprint(self) -> str:
        """``sha256:...`` over the config, every weight file and the truncation."""
        digest = hashlib.sha256()
        digest.update(f"layers={self.layers or 'all'}\n".encode())
        config = distilled.CONFIG_NAME if self.distilled else "config.json"
        for file in [self.path / config, *self._weight_files()]:
            digest.update(f"{file.name}\n".encode())
            with file.open("rb") as f:
                while block := f.read(_CHUNK):
                    digest.update(block)
        return f"sha256:{digest.hexdigest()}"

    def load_config(self) -> Any:
        from transformers import AutoConfig, LlamaConfig

        if self.distilled:
            return LlamaConfig.from_dict(distilled.DraftInfo.load(self.path).model)
        config = AutoConfig.from_pretrained(self.path)
        if self.layers is not None:
            total = int(config.num_hidden_layers)
            if self.layers > total:
                raise DraftSourceError(
                    f"{self.spec!r}: the model has only {total} layers")
            config.num_hidden_layers = self.layers
            if getattr(config, "layer_types", None):
                config.layer_types = list(config.layer_types)[: self.layers]
        return config

    def load_model(self, dtype: str = "float32", device: str = "cpu") -> Any:
        """The transformers model (eval mode), truncated when the spec asks for it."""
        from transformers import AutoModelForCausalLM

        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
        if self.distilled:
            target = AutoModelForCausalLM.from_pretrained(self._target_path(), dtype=DTYPES[dtype])
            draft = distilled.load_model(self.path, target, dtype)
            return draft.to(torch.device(device)).eval()
        config = self.load_config()
        with _quiet_transformers(self.layers is not None):
            model: Any = AutoModelForCausalLM.from_pretrained(
                self.path, config=config, dtype=DTYPES[dtype])
        return model.to(torch.device(device)).eval()

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self._target_path() if self.distilled else self.path)

    def _target_path(self) -> str:
        """A distilled draft's target, as ``specserve distill --target`` named it."""
        return model_store.resolve(str(distilled.DraftInfo.load(self.path).made_with["target"]))

    def load_causal_lm(self, dtype: str = "float32", device: str = "cpu") -> CausalLM:
        return TransformersLM(self.load_model(dtype, device), self.load_tokenizer(), name=self.spec)

    def _weight_files(self) -> list[Path]:
        files = sorted(p for p in self.path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
        if not files:
            raise DraftSourceError(f"no weight files (*.safetensors, *.bin) in {self.path}")
        return files


@contextlib.contextmanager
def _quiet_transformers(enabled: bool) -> Iterator[None]:
    """Truncating leaves the dropped layers' weights unused; that report is expected."""
    if not enabled:
        yield
        return
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)
