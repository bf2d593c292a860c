"""What the runtime reads of a decoder-only causal LM's modules.

transformers' ``*ForCausalLM`` and the skeleton (``runtime.models.skeleton``) are both
one: a decoder (``model``) of embeddings, layers, a final norm and rotary embeddings, an
output head, a config read by attribute, and a forward call. These protocols name what
the runners and loaders use of them, so that a misspelt module is a type error rather
than an ``AttributeError`` at load.

``nn.Module`` types its submodules loosely (``Tensor | Module``), and ``nn.ModuleList`` its
items as ``Module``; ``decoder_layers`` and ``input_embedding`` are the two places where
modules are taken to be what these protocols say.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, Self, cast

import torch
from torch import Tensor, nn


class AttentionModules(Protocol):
    scaling: float
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear


class MlpModules(Protocol):
    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear
    act_fn: nn.Module


class LayerModules(Protocol):
    """One decoder layer: attention and MLP, each after its norm (Gemma's layers also
    norm their outputs: ``post_feedforward_layernorm``, read where present)."""

    self_attn: AttentionModules
    mlp: MlpModules
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module


class DecoderModules(Protocol):
    """The decoder: read-only here, since the skeleton's are narrower types."""

    @property
    def embed_tokens(self) -> nn.Module: ...

    @property
    def layers(self) -> nn.ModuleList: ...

    @property
    def norm(self) -> nn.Module: ...

    @property
    def rotary_emb(self) -> nn.Module: ...


class Weighted(Protocol):
    """A module whose weight the runtime reads or replaces: a linear layer, an embedding,
    the output head (a draft's may cover part of the vocabulary: its rows' ``ids`` and
    the whole ``vocab_size`` beside its weight)."""

    weight: Tensor


class CausalModel(Protocol):
    """A causal LM as the runtime reads it. Its config is read by attribute, and is
    transformers' or a plain namespace (the skeleton's), so it stays untyped; so do the
    forward call's arguments, which are transformers' own."""

    @property
    def config(self) -> Any: ...

    @property
    def model(self) -> DecoderModules: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def get_input_embeddings(self) -> nn.Module: ...

    def get_output_embeddings(self) -> Weighted: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def eval(self) -> Self: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class InputEmbedding(Protocol):
    """The input embedding: an ``nn.Embedding``, or a module that converts or dequantizes
    its rows as they are looked up (``skeleton.ConvertedEmbedding``,
    ``quantized.BlockEmbedding``); each has the table's sizes."""

    num_embeddings: int
    embedding_dim: int

    def __call__(self, ids: Tensor) -> Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


def input_embedding(model: CausalModel) -> InputEmbedding:
    """The model's input embedding, as ``InputEmbedding`` says."""
    return cast(InputEmbedding, model.get_input_embeddings())


def decoder_layers(model: CausalModel) -> list[LayerModules]:
    """The model's decoder layers, in order."""
    return cast(list[LayerModules], list(model.model.layers))
