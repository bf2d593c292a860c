"""The model that scores drafts, as the speculative core sees it.

The runtime's runners (``runtime.runner.causal_lm.CausalLM``: ``TransformersLM`` and
``runtime.runner.batched.BatchedLM``) implement it; the core never builds a target, it
is handed one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from runtime.runner.passes import BatchItem, KVUsage, PreparedPass, TargetCapabilities

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

class SequenceState(Protocol):
    """What the core reads of a target's per-sequence state (its KV cache's handle)."""

    length: int  # the positions it caches


StateT = TypeVar("StateT", bound=SequenceState)  # a target's per-sequence state


class Target(Protocol[StateT]):
    """The model that scores drafts: a forward pass over a batch of (sequence, new
    tokens) gives logits for every kept position; each sequence's KV rolls back to a
    length. ``TransformersLM`` (one sequence per pass) and ``BatchedLM`` implement it."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]

    @property
    def capabilities(self) -> TargetCapabilities: ...

    @property
    def num_layers(self) -> int: ...

    def new_state(self) -> StateT: ...

    def forward_batch(self, items: Sequence[BatchItem[StateT]]) -> list[torch.Tensor]:
        """Each item's tokens appended to its sequence; each item's kept logits,
        ``[keep, vocab]`` (``run_pass`` of ``prepare_pass``)."""
        ...

    def prepare_pass(self, items: Sequence[BatchItem[StateT]]) -> PreparedPass[StateT]:
        """The pass checked and built up to its long call, which ``run_pass`` makes
        (the GIL mostly released): between the two the engine hands its events over."""
        ...

    def run_pass(self, prepared: PreparedPass[StateT]) -> list[torch.Tensor]: ...

    def first_largest(self, scores: torch.Tensor) -> list[int]:
        """Each row's first largest score's index, exactly ``scores.float().argmax(-1)``
        (greedy's pick; the runner's kernels may make it without the widened copy)."""
        ...

    def rollback(self, state: StateT, length: int) -> None:
        """Forget every cached position at or after ``length``."""
        ...

    def adopt_alternative(self, state: StateT, start: int, n: int) -> None:
        """Keep ``token_ids[0]`` and the alternative of a pass of ``n`` tokens from
        ``start`` (only with ``capabilities.branches``)."""
        ...

    def release(self, state: StateT) -> None: ...

    def load_kv(self, state: StateT, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None: ...

    def kv(self, state: StateT) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    # the KV cache in blocks of positions (``runtime.runner.kv_blocks``)
    @property
    def kv_block_bytes(self) -> int: ...

    def set_kv_budget(self, max_bytes: int | None) -> None:
        """Hold at most ``max_bytes`` of KV (None: no bound)."""
        ...

    def kv_usage(self) -> KVUsage: ...

    def kv_needed(self, state: StateT, positions: int) -> int:
        """The blocks ``state`` would take to hold ``positions`` positions."""
        ...

    def share_prefix(self, state: StateT, token_ids: Sequence[int]) -> int:
        """For an empty ``state``: hold the published blocks of the longest prefix of
        ``token_ids`` (its last token left to compute); the positions held."""
        ...

    def publish_prefix(self, state: StateT, token_ids: Sequence[int]) -> None:
        """Let later sequences share ``state``'s full blocks of ``token_ids``."""
        ...

    def warmup(self) -> None: ...
