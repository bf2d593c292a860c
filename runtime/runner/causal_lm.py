"""A causal LM's runner, and the one over transformers' own model with its KV cache
kept between rounds.

``CausalLM`` is what every runner is: the model's sizes and tokenizer, and the calls of
``decoding.target.Target`` over its own per-sequence state. ``TransformersLM`` runs one
sequence a forward pass through transformers' model (families the batched runner,
``runtime.runner.batched.BatchedLM``, does not cover, and training); either serves as the
target and as a model drafter: prefill a prompt, score a few tokens in one forward pass,
roll the cache back to a length. What a pass takes is ``passes``'s; what a model
family's config says is ``families``'.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from transformers import DynamicCache

from runtime.models.causal_model import CausalModel
from runtime.models.checkpoints import transformers_pretrained
from runtime.models.families import attention_dims, kv_position_bytes
from runtime.native import kernels
from runtime.runner.passes import (
    BLOCK,
    BatchItem,
    KVUsage,
    PreparedPass,
    TargetCapabilities,
    blocks_for,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

S = TypeVar("S")  # a runner's per-sequence state: its KV cache's handle


@dataclass
class CacheState:
    """One sequence's KV cache and how many tokens it holds."""

    cache: DynamicCache
    length: int = 0


def head_subset(model: CausalModel) -> torch.Tensor | None:  # [K]
    """The vocabulary ids of the output head's rows when it covers only part of the
    vocabulary (a distilled draft's head keeps ``ids`` and the full ``vocab_size``)."""
    return getattr(model.get_output_embeddings(), "ids", None)


def output_vocab_size(model: CausalModel) -> int:
    """How many vocabulary logits the model returns (all of them, for a subset head)."""
    head = model.get_output_embeddings()
    whole = getattr(head, "vocab_size", None) if head_subset(model) is not None else None
    return int(whole if whole is not None else head.weight.shape[0])


class CausalLM(Generic[S]):
    """A runner of a causal LM: its sizes, its tokenizer, and the ``Target`` calls over
    its per-sequence state ``S`` (``TransformersLM``: one sequence a pass;
    ``runtime.runner.batched.BatchedLM``: many)."""

    def __init__(self, model: CausalModel, tokenizer: PreTrainedTokenizerBase,
                 name: str = "model") -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        config = model.config
        self.vocab_size = output_vocab_size(model)
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids = frozenset(eos_ids(model, tokenizer))
        self.heads, self.kv_heads, self.head_dim = attention_dims(config)
        self.hidden_size = int(config.hidden_size)
        self.kv_position_bytes = kv_position_bytes(config, self.dtype)
        self._kv_limit: int | None = None  # the KV budget in blocks (None: no bound)

    @property
    def capabilities(self) -> TargetCapabilities:
        raise NotImplementedError

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    def new_state(self) -> S:
        raise NotImplementedError

    @torch.inference_mode()
    def prefill(self, state: S, token_ids: Sequence[int]) -> torch.Tensor:  # [vocab]
        """Append ``token_ids`` to the cache; return the logits after the last one."""
        return self.forward_batch([BatchItem(state, token_ids, 1)])[0][0]

    @torch.inference_mode()
    def score(self, state: S, token_ids: Sequence[int]) -> torch.Tensor:  # [n, vocab]
        """Append ``token_ids`` to the cache; return the logits after each of them."""
        return self.forward_batch([BatchItem(state, token_ids, len(token_ids))])[0]

    def forward_batch(self, items: Sequence[BatchItem[S]]) -> list[torch.Tensor]:
        """Each item's new tokens appended to its sequence; the kept logits of each,
        ``[keep, vocab]``, in the order given."""
        return self.run_pass(self.prepare_pass(items))

    def prepare_pass(self, items: Sequence[BatchItem[S]]) -> PreparedPass[S]:
        """A pass checked and made ready up to its long call (``run_pass``)."""
        raise NotImplementedError

    def run_pass(self, prepared: PreparedPass[S]) -> list[torch.Tensor]:
        raise NotImplementedError

    def adopt_alternative(self, state: S, start: int, n: int) -> None:
        """After a pass of ``n`` tokens from position ``start`` whose last was an
        alternative that verification took: the cache ends with ``token_ids[0]`` then
        the alternative (everything else of the pass is forgotten)."""
        raise NotImplementedError(f"{self.name} does not run token trees")

    def rollback(self, state: S, length: int) -> None:
        """Forget every cached position at or after ``length``."""
        raise NotImplementedError

    def release(self, state: S) -> None:
        """Give the sequence's KV back."""
        raise NotImplementedError

    def load_kv(self, state: S, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start an empty cache from saved KV: per layer [1, heads, tokens, head_dim] each."""
        raise NotImplementedError

    def kv(self, state: S) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cached KV, per layer [1, heads, length, head_dim] each (views, not copies)."""
        raise NotImplementedError

    # -- the KV budget, in blocks of positions (``runtime.runner.kv_blocks``) ----------

    @property
    def kv_block_bytes(self) -> int:
        """The KV of one block of positions, every layer's keys and values."""
        return BLOCK * self.kv_position_bytes

    def set_kv_budget(self, max_bytes: int | None) -> None:
        """Hold at most ``max_bytes`` of KV (None: no bound), in whole blocks."""
        self._kv_limit = None if max_bytes is None else max(1, max_bytes // self.kv_block_bytes)

    def kv_usage(self) -> KVUsage:
        """The blocks the budget allows and those the sequences hold."""
        raise NotImplementedError

    def kv_needed(self, state: S, positions: int) -> int:
        """The blocks ``state`` would take to hold ``positions`` positions."""
        raise NotImplementedError

    def share_prefix(self, state: S, token_ids: Sequence[int]) -> int:
        """For an empty ``state``: hold the blocks other sequences published of the longest
        prefix of ``token_ids`` they share (leaving the last token); the positions held.
        Nothing here: each sequence's cache is its own."""
        return 0

    def publish_prefix(self, state: S, token_ids: Sequence[int]) -> None:
        """Let later sequences share ``state``'s full blocks of ``token_ids`` (its first
        positions, written). Nothing here."""

    def warmup(self) -> None:
        """Build whatever the first passes would otherwise build while serving."""

    def first_largest(self, scores: torch.Tensor) -> list[int]:
        """Each row's first largest score's index, as ``scores.float().argmax(-1)``: on
        the native kernels where this process loaded them (``kernels.first_largest``)."""
        return kernels.first_largest(scores)


class TransformersLM(CausalLM[CacheState]):
    """Prefill / score / rollback over transformers' own model, one sequence per forward
    pass (the ``Target`` of models the batched runner does not cover)."""

    def __init__(self, model: CausalModel, tokenizer: PreTrainedTokenizerBase,
                 name: str = "model") -> None:
        super().__init__(model, tokenizer, name)
        self._live: dict[int, CacheState] = {}  # by id: the sequences not released

    @property
    def capabilities(self) -> TargetCapabilities:
        return ONE_SEQUENCE

    @classmethod
    def load(cls, path: str, dtype: str = "float32", device: str = "cpu") -> TransformersLM:
        return cls(*transformers_pretrained(path, dtype, device), name=str(path))

    def new_state(self) -> CacheState:
        state = CacheState(cache=DynamicCache(config=self.model.config))
        self._live[id(state)] = state
        return state

    def kv_usage(self) -> KVUsage:
        """Counted from the sequences' lengths: each sequence's cache is its own."""
        used = sum(blocks_for(state.length) for state in self._live.values())
        return KVUsage(self._kv_limit, used, 0)

    def kv_needed(self, state: CacheState, positions: int) -> int:
        return max(0, blocks_for(positions) - blocks_for(state.length))

    @torch.inference_mode()
    def prefill(self, state: CacheState, token_ids: Sequence[int]) -> torch.Tensor:  # [vocab]
        return self._forward(state, token_ids, keep=1)[0]

    @torch.inference_mode()
    def score(self, state: CacheState, token_ids: Sequence[int]) -> torch.Tensor:  # [n, vocab]
        return self._forward(state, token_ids, keep=len(token_ids))

    def prepare_pass(self, items: Sequence[BatchItem[CacheState]]
                     ) -> PreparedPass[CacheState]:
        """A pass made ready to run (here: checked; every pass is a long call)."""
        if any(item.alternative for item in items):
            raise ValueError(f"{self.name} does not run token trees")
        if any(item.features or item.inputs is not None for item in items):
            raise ValueError(f"{self.name} gives no hidden states and takes no input rows")
        return PreparedPass(items)

    @torch.inference_mode()
    def run_pass(self, prepared: PreparedPass[CacheState]) -> list[torch.Tensor]:
        """Run a prepared pass, one forward call per sequence: the kept logits of each."""
        return [self._forward(item.state, item.token_ids, keep=max(1, item.keep))[-item.keep:]
                if item.keep else self._forward(item.state, item.token_ids, keep=1)[:0]
                for item in prepared.items]

    def release(self, state: CacheState) -> None:
        """Free the sequence's cache."""
        self.rollback(state, 0)
        self._live.pop(id(state), None)

    def rollback(self, state: CacheState, length: int) -> None:
        if length < state.length:
            state.cache.crop(length - state.length)  # transformers 5: a negative count
            state.length = length

    def load_kv(
        self, state: CacheState, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        if state.length:
            raise ValueError("load_kv needs an empty cache")
        for layer, (keys, values) in enumerate(kv):
            state.cache.update(keys.to(self.device, self.dtype), values.to(self.device, self.dtype),
                               layer)
        state.length = int(kv[0][0].shape[2]) if kv else 0

    def kv(self, state: CacheState) -> list[tuple[torch.Tensor, torch.Tensor]]:
        layers: list[Any] = list(state.cache.layers)
        return [(layer.keys, layer.values) for layer in layers]

    def _forward(self, state: CacheState, token_ids: Sequence[int], keep: int) -> torch.Tensor:
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(
            input_ids=ids,
            cache=state.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        state.length += ids.shape[1]
        return out.logits[0]  # [keep, vocab]


ONE_SEQUENCE = TargetCapabilities(batched=False, branches=False)


def eos_ids(model: CausalModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
