"""Reading checkpoints: a model directory's weights, generation settings and tokenizer,
as the batched families' modules (``skeleton.Skeleton``) where they can be, else as
transformers' own model (``transformers_pretrained``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runtime.files.model_config import model_config, tokenizer
from runtime.models.skeleton import Skeleton, unbuildable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def generation_settings(directory: Path) -> dict[str, object]:
    """A model directory's ``generation_config.json`` (its end-of-sequence ids), or {}."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}
    settings: dict[str, object] = json.loads(path.read_text())
    return settings


def safetensors_files(directory: Path) -> list[Path]:
    """The directory's safetensors weights (one file or an index's shards), or []."""
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return []
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [directory / name for name in shards]


def pretrained(path: str, dtype: str, device: str) -> tuple[Any, PreTrainedTokenizerBase]:
    """A model directory's model in ``dtype`` on ``device`` and its tokenizer: a skeleton
    where it can be one (a batched family in safetensors), else transformers' model
    (``transformers_pretrained``)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    directory = Path(path)
    files = safetensors_files(directory) if directory.is_dir() else []
    config = model_config(directory) if files else None
    if config is None or unbuildable(config) is not None:
        return transformers_pretrained(path, dtype, device)
    model = Skeleton(config, DTYPES[dtype], generation_settings(directory))
    model.fill(read_safetensors(files), str(directory))
    model.weight_files = tuple(files)  # where a server may read rows later (its input embedding)
    return model.to(device).eval(), tokenizer(directory, config)


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as weights:
            for key in weights.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                state[key] = weights.get_tensor(key)
    return state


def transformers_pretrained(path: str, dtype: str, device: str
                            ) -> tuple[Any, PreTrainedTokenizerBase]:
    """A model directory's (or hub id's) model in ``dtype`` on ``device``, and its tokenizer."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    words = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    return torch.nn.Module.to(model, device), words  # (transformers types .to oddly)
