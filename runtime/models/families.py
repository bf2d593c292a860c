"""Model families: which the batched runner covers, why the others are not, and what a
family's config says of its layers (windows, activation, attention sizes, KV bytes)."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from runtime.files.model_config import ModelConfig

BATCHED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text"})
# families whose layers are Gemma's: norms of (1 + weight) after attention and around the MLP,
# scaled embeddings, sliding-window layers with their own rotary base
GEMMA_FAMILIES = frozenset({"gemma3_text"})
# families whose every layer attends within ``sliding_window`` positions, where it is set
WINDOWED_FAMILIES = frozenset({"mistral", "phi3"})
# families whose files fuse q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``)
FUSED_FAMILIES = frozenset({"phi3"})
# Why a family's decoder layers are not the batched runner's, which are Llama's (RMS
# pre-norms, separate q/k/v and gate/up projections, rotary on all of q and k, SiLU gating)
FAMILY_GAPS = {
    "gemma": "its RMS norms scale by 1 + weight, its embeddings by sqrt(hidden), and its MLP "
             "gates with GELU",
    "gemma2": "it soft-caps attention scores and logits, alternates sliding-window and global "
              "layers, adds norms after attention and MLP, and gates with GELU",
    "phi": "its attention and MLP run side by side off one LayerNorm, with a partial rotary "
           "embedding and GELU",
}


class ConfiguredModel(Protocol):
    """A causal LM with its config: transformers' model or a ``skeleton.Skeleton``."""

    @property
    def config(self) -> ModelConfig: ...


def unsupported_family(model_type: str | None, supported: Collection[str]) -> str:
    """One line: the model type is not a batched family, and where it is a known one, what
    its layers do that the batched runner's do not."""
    line = f"model type {model_type!r} is not one of {sorted(supported)}"
    gap = FAMILY_GAPS.get(model_type or "")
    return f"{line}: {gap}" if gap else line


def supports(model: ConfiguredModel) -> str | None:
    """Why ``model`` cannot run batched (``batched.BatchedLM``), or None when it can."""
    reason = unbatchable(model.config)
    if reason is not None:
        return reason
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "the model does not have the usual decoder layout"
    if needs_skeleton(model.config) and not getattr(model, "is_skeleton", False):
        return ("transformers' modules of this model (sliding windows, fused projections or "
                "a rotary embedding per kind of layer) are not the runner's: its skeleton's are")
    return None


def needs_skeleton(config: ModelConfig) -> bool:
    """Whether the runner takes a model of ``config`` only as ``skeleton.Skeleton``'s
    modules (which ``BatchedLM.wrap`` rebuilds from transformers' model)."""
    family = getattr(config, "model_type", None)
    return (family in GEMMA_FAMILIES or family in FUSED_FAMILIES
            or any(layer_window(config, i) for i in range(int(config.num_hidden_layers))))


def layer_window(config: ModelConfig, index: int) -> int | None:
    """How many positions up to its own a query of layer ``index`` sees (its own
    included), or None: all of them."""
    family = getattr(config, "model_type", None)
    window = getattr(config, "sliding_window", None)
    if family in GEMMA_FAMILIES:
        sliding = config.layer_types[index] == "sliding_attention"
        return int(window) if sliding and window else None
    longest = getattr(config, "max_position_embeddings", None) or 1 << 30
    if family in WINDOWED_FAMILIES and window and window < longest:
        return int(window)
    return None


def activation(config: ModelConfig) -> str:
    """The MLP's activation as a config names it (Gemma's ``hidden_activation``)."""
    return str(getattr(config, "hidden_activation", None)
               or getattr(config, "hidden_act", None) or "silu")


def unbatchable(config: ModelConfig) -> str | None:
    """Why a model of ``config`` cannot run batched, or None when its family and
    attention can."""
    model_type = getattr(config, "model_type", None)
    if model_type not in BATCHED_MODEL_TYPES:
        return unsupported_family(model_type, BATCHED_MODEL_TYPES)
    if model_type in GEMMA_FAMILIES:
        return _gemma_gap(config)
    if model_type == "phi3":
        rope = config.rope_parameters
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            return "its rotary embedding covers part of each head (partial_rotary_factor)"
        if rope.get("rope_type", "default") != "default":
            return ("its long-context rotary embedding recomputes every cached position once "
                    "a sequence passes original_max_position_embeddings")
    if model_type in WINDOWED_FAMILIES:
        return None  # each layer's window: layer_window
    window = getattr(config, "sliding_window", None)
    longest = getattr(config, "max_position_embeddings", None) or 1 << 30
    if window and getattr(config, "use_sliding_window", True) and window < longest:
        return "sliding-window attention is not supported"
    return None


def _gemma_gap(config: ModelConfig) -> str | None:
    """Why a Gemma 3 model cannot run batched (its sliding-window layers can), or None."""
    if getattr(config, "use_bidirectional_attention", False):
        return "its attention is bidirectional"
    for what in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, what, None) is not None:
            return f"it soft-caps scores ({what})"
    kinds = {p.get("rope_type", "default") for p in config.rope_parameters.values() if p}
    if kinds - {"default", "linear"}:
        return f"rope types {sorted(kinds)}: only default and linear run per kind of layer"
    return None


def attention_dims(config: ModelConfig) -> tuple[int, int, int]:
    """Query heads, key/value heads and the size of a head, from a transformers config."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return heads, kv_heads, head_dim


def kv_position_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """The keys and values of every layer for one position of one sequence, in bytes."""
    _, kv_heads, head_dim = attention_dims(config)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * int(config.num_hidden_layers) * kv_heads * head_dim * element
