"""What the batched runner's layer paths read: its decoder stack, as one typed object.

``BatchedLM`` holds one ``Stack`` and hands it to the paths that run its layers
(``runtime.runner.fused``, the native kernels'; ``runtime.runner.layers``, PyTorch's), to the draft
chain (``fused.draft_chain``) and to ``runtime.runner.memory``. The stack is the one holder of
what changes while the runner lives: the KV pools (``KVBlocks`` grows and shrinks
them), the native kernels with their norms and loops (``BatchedLM.use_kernels``;
``memory.release_plain_weights`` makes them anew), the captured layers; a path reads
them here at every call, so it sees the current ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol

import torch
from torch import nn

from runtime.matrices.weights import LayerWeights, Product
from runtime.models.causal_model import CausalModel, DecoderModules, LayerModules
from runtime.runner.attention import GroupedAttention

Norm = tuple[torch.Tensor, float]  # an RMS norm's weight (in the activations' dtype), eps
# rotary embeddings whose cos/sin depend on the position alone (not on the sequence length,
# as "dynamic" scaling's do): looked up in a table
STATIC_ROPE = frozenset({"default", "linear", "llama3"})


class NativeLoop(Protocol):
    """The kernels' loop over a run of layers (``LayerStack``, ``fused.layer_stack``)."""

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor], tables: torch.Tensor,
                rows: torch.Tensor, slots: torch.Tensor, limits: torch.Tensor,
                extras: torch.Tensor) -> torch.Tensor:  # [T, H]
        ...


class Rotary:
    """The model's rotary cos/sin for a pass's positions, ``[T, D]`` each. Where they
    depend on the position alone, the model's own rotary embedding runs once over the
    positions seen so far (the table doubles as sequences grow) and a pass looks its
    positions up: bitwise what running it per pass gives (each value is one product and
    its cos/sin), 10 us a pass instead of 36 (one token, one thread)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.static = getattr(module, "rope_type", "default") in STATIC_ROPE
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor,
                 needed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``needed``: one past the largest of ``positions`` where the caller knows it
        (else it is read from the tensor)."""
        if not self.static:
            cos, sin = self.module(hidden, positions[None])  # [1, T, D]
            return cos[0].contiguous(), sin[0].contiguous()
        if needed is None:
            needed = int(positions.max()) + 1
        if self._cos is None or self._cos.shape[0] < needed:
            size = max(1024, 1 << (needed - 1).bit_length())
            every = torch.arange(size, device=positions.device)[None]
            cos, sin = self.module(hidden[:1], every)
            self._cos, self._sin = cos[0].contiguous(), sin[0].contiguous()
        assert self._sin is not None
        return self._cos[positions], self._sin[positions]

    def tables(self, needed: int, like: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole cos/sin tables, ``[P, D]`` each with ``P >= needed``, rows by
        position (``like``: a tensor of the activations' dtype and device); None where
        they depend on more than the position."""
        if not self.static:
            return None
        self(like[:1], torch.tensor([needed - 1], device=like.device))
        assert self._cos is not None and self._sin is not None
        return self._cos, self._sin


@dataclass(eq=False)
class Stack:
    """A ``BatchedLM``'s decoder stack: the model's modules it reads, its matrices, its
    attention shape, its KV buffers and, where they run, the native kernels and their
    loops. The first group is fixed at load; the rest ``BatchedLM`` replaces here."""

    model: CausalModel  # the causal LM (transformers' or ``skeleton``'s) whose modules these are
    layers: list[LayerModules]  # its decoder layers' modules, in order
    weights: list[LayerWeights]  # [layer] the matrices a pass multiplies by, and the norms
    head: Product  # the output head (over ``head_ids`` where that is not None)
    head_ids: torch.Tensor | None  # [K]: the vocabulary ids of a subset head's rows
    rotary: Rotary  # cos/sin by position
    attention: GroupedAttention  # the PyTorch path's attention
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float  # attention's
    dtype: torch.dtype  # the activations' and the KV buffers'
    # [layer] each a pool [blocks, kv_heads, BLOCK, head_dim] (``runtime.runner.kv_blocks``)
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    kernels: ModuleType | None = None  # the native kernels (``runtime.native.kernels``), or None
    norms: list[Norm] = field(default_factory=list)  # 2 a layer, then the final norm
    layer_stack: NativeLoop | None = None  # every layer in one native call, or None
    captured: tuple[int, ...] = ()  # layers whose outputs a pass hands out
    # loops over runs of layers cut after each captured one (``fused.layer_segments``)
    segments: list[tuple[range, NativeLoop]] | None = None

    @property
    def inner(self) -> DecoderModules:
        """The model's decoder module: ``embed_tokens``, ``rotary_emb``, ``layers``, ``norm``."""
        return self.model.model
