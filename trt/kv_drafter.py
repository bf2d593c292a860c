"""A drafter over any engine that runs the exported decoding step.

The exported step takes token ids plus the KV cache as explicit tensors and
returns the next-token logits plus the grown cache. ``KVDrafter`` drives such
an engine exactly as ``decoding.drafters.model.ModelDrafter`` drives a PyTorch
model: it reuses the common prefix of what it fed and what is committed, feeds
the rest, then proposes k tokens one step at a time (greedy argmax, or sampling
with the request's generator, returning the distributions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from decoding.drafters.base import DraftContext, DraftProposal
from decoding.sampling import logits_to_probs
from decoding.target import CausalLM, check_same_vocabulary


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


@dataclass
class KVDraftState:
    cache: KVCache
    fed: list[int] = field(default_factory=list)  # tokens whose KV is in the cache


class KVDrafter:
    """The Drafter protocol over a ``StepEngine`` (ONNX Runtime or TensorRT)."""

    def __init__(
        self,
        engine: StepEngine,
        tokenizer: Any,
        target: CausalLM | None = None,
        name: str = "draft",
    ) -> None:
        if target is not None:
            check_same_vocabulary(target.tokenizer, tokenizer, name)
        self.engine = engine
        self.name = name
        self.target_vocab = target.vocab_size if target is not None else engine.vocab_size

    def begin(self, prompt_ids: Sequence[int]) -> KVDraftState:
        return KVDraftState(cache=self.engine.empty_cache())

    @torch.inference_mode()
    def propose(self, state: KVDraftState, context: DraftContext, k: int) -> DraftProposal:
        tokens = context.token_ids
        if k <= 0:
            return DraftProposal.empty()
        common = _common_prefix(state.fed, tokens)
        if common == len(tokens):  # must feed at least one token to get logits
            common -= 1
        state.cache.crop(common)
        del state.fed[common:]
        logits = self.engine.step(state.cache, tokens[common:])  # [vocab]
        state.fed.extend(tokens[common:])
        proposed: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            token, probs = self._pick(logits, context)
            proposed.append(token)
            if probs is not None:
                rows.append(probs)
            if i + 1 < k:
                logits = self.engine.step(state.cache, [token])
                state.fed.append(token)
        probs_all = torch.stack(rows) if rows else None  # [k, vocab]
        return DraftProposal(tokens=tuple(proposed), probs=probs_all)

    def rollback(self, state: KVDraftState, length: int) -> None:
        if length < len(state.fed):
            state.cache.crop(length)
            del state.fed[length:]

    def release(self, state: KVDraftState) -> None:
        state.cache = self.engine.empty_cache()
        state.fed.clear()

    def _pick(
        self, logits: torch.Tensor, context: DraftContext  # [vocab]
    ) -> tuple[int, torch.Tensor | None]:
        logits = fit_vocab(logits, self.target_vocab)
        if context.generator is None:
            return int(logits.argmax().item()), None
        logits = logits.to(context.generator.device)  # the target's device
        probs = logits_to_probs(logits.unsqueeze(0), context.sampling)[0]  # [vocab]
        token = int(torch.multinomial(probs, 1, generator=context.generator).item())
        return token, probs


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def fit_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:  # [vocab] -> [size]
    """Pad (with -inf) or trim draft logits to the target's vocabulary size."""
    if logits.shape[-1] == size:
        return logits
    if logits.shape[-1] > size:
        return logits[..., :size]
    pad = torch.full((size - logits.shape[-1],), float("-inf"), dtype=logits.dtype,
                     device=logits.device)
    return torch.cat([logits, pad])
