"""A drafter over any engine that runs the exported decoding step.

The exported step takes token ids plus the KV cache as explicit tensors and
returns the next-token logits plus the grown cache. ``KVDrafter`` drives such
an engine exactly as ``drafters.model.ModelDrafter`` drives a PyTorch
model: it reuses the common prefix of what it fed and what is committed, feeds
the rest, then proposes k tokens one step at a time (greedy argmax, or sampling
with the request's keyed noise or generator, returning the distributions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from drafters.model import ModelDrafter
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import BatchItem, TargetCapabilities


@dataclass
class KVCache:
    """One sequence's draft KV cache as the exported step's tensors."""

    tensors: list[torch.Tensor]  # 2 * layers of [1, kv_heads, length, head_dim]: k0, v0, k1, ...
    length: int = 0

    def crop(self, length: int) -> None:
        """Forget every position at or after ``length`` (contiguous again for the engine)."""
        if length < self.length:
            self.tensors = [t[:, :, :length].contiguous() for t in self.tensors]
            self.length = length


class StepEngine(Protocol):
    """Runs the exported decoding step."""

    runtime: str  # what runs it, for logs and metadata
    vocab_size: int

    def empty_cache(self) -> KVCache: ...

    def step(self, cache: KVCache, token_ids: Sequence[int]) -> torch.Tensor:  # [vocab]
        """Append ``token_ids`` to ``cache``; return the logits after the last one."""
        ...


class _StepModel:
    """A ``StepEngine`` in the shape ``ModelDrafter`` drives (``DraftModel``)."""

    # one sequence a step, drafted step by step
    capabilities = TargetCapabilities(batched=False, branches=False)

    def __init__(self, engine: StepEngine, tokenizer: Any) -> None:
        self.engine = engine
        self.vocab_size = engine.vocab_size
        self.tokenizer = tokenizer
        self.name = engine.runtime

    def new_state(self) -> KVCache:
        return self.engine.empty_cache()

    def forward_batch(self, items: Sequence[BatchItem]) -> list[torch.Tensor]:
        """One step per item (an exported step runs one sequence at a time)."""
        return [self.engine.step(item.state, item.token_ids)[None] for item in items]

    def rollback(self, state: KVCache, length: int) -> None:
        state.crop(length)

    def release(self, state: KVCache) -> None:
        state.crop(0)

    def warmup(self) -> None:
        return None


class KVDrafter(ModelDrafter):
    """The model drafter over a ``StepEngine`` (ONNX Runtime or TensorRT)."""

    def __init__(
        self,
        engine: StepEngine,
        tokenizer: Any,
        target: CausalLM | None = None,
        name: str = "draft",
    ) -> None:
        super().__init__(_StepModel(engine, tokenizer), target, tokenizer=tokenizer, name=name)
        self.engine = engine
