"""A model directory's config and tokenizer, read without transformers' config classes
where the config states what the batched families need (``runtime.models.skeleton`` builds
from them): importing any of those classes costs a process ~50 MB (their validators
import the activations, which bring torch.distributed and sympy).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    # transformers' config class, or ``read_config``'s namespace of the same fields
    ModelConfig: TypeAlias = PretrainedConfig | SimpleNamespace

# What a config.json may leave out, as transformers' config classes fill it in
DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False, "mlp_bias": False,
    "head_dim": None, "tie_word_embeddings": False, "num_key_value_heads": None}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {}, "mistral": {"sliding_window": 4096},
    "qwen2": {"sliding_window": 4096, "use_sliding_window": False},
    "qwen3": {"head_dim": 128, "sliding_window": 4096, "use_sliding_window": False}}
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "vocab_size", "max_position_embeddings")
STATED = ("eos_token_id",)  # the families' defaults differ: read_config wants it stated


def read_config(values: Mapping[str, Any]) -> SimpleNamespace | None:
    """A model config's values (config.json's) as the skeleton and the runners read them,
    without transformers' config classes: importing any of them costs a process ~50 MB
    (their validators import the activations, which bring torch.distributed and sympy).
    None where transformers' class should read it: another family, a rope kind other
    than the default (its frequencies come from transformers' functions, given its
    class), a value left to a default not in ``DEFAULTS``."""
    family = values.get("model_type")
    if (family not in FAMILY_DEFAULTS or any(values.get(k) is None for k in REQUIRED)
            or any(k not in values for k in STATED)):
        return None
    rope = dict(values.get("rope_parameters") or values.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return None
    theta = rope.get("rope_theta", values.get("rope_theta")) or 10000.0
    config = {**DEFAULTS, **FAMILY_DEFAULTS[family], **values,
              "rope_parameters": {"rope_type": "default", "rope_theta": float(theta)}}
    if config["num_key_value_heads"] is None:
        config["num_key_value_heads"] = config["num_attention_heads"]
    return SimpleNamespace(**config)


def model_config(directory: Path) -> ModelConfig:
    """The directory's config: ``read_config``'s, else transformers' ``AutoConfig``."""
    light = read_config(json.loads((directory / "config.json").read_text()))
    if light is not None:
        return light
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


def tokenizer(directory: Path, config: ModelConfig) -> PreTrainedTokenizerBase:
    """The directory's tokenizer by ``AutoTokenizer``, given ``config`` where it names its
    tokenizer class itself (else AutoTokenizer reads the model's config, by its class)."""
    from transformers import AutoTokenizer

    settings = directory / "tokenizer_config.json"
    named = settings.is_file() and "tokenizer_class" in json.loads(settings.read_text())
    if isinstance(config, SimpleNamespace) and named:
        return AutoTokenizer.from_pretrained(directory, config=config)
    return AutoTokenizer.from_pretrained(directory)
