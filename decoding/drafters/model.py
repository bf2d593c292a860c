"""A small causal LM as the drafter (any model that shares the target's tokenizer)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from decoding.drafters.base import DraftContext, DraftProposal
from decoding.sampling import logits_to_probs
from decoding.target import CacheState, CausalLM, check_same_vocabulary


@dataclass
class ModelDraftState:
    cache: CacheState
    fed: list[int] = field(default_factory=list)  # tokens whose KV is in the cache


class ModelDrafter:
    def __init__(self, model: CausalLM, target: CausalLM | None = None) -> None:
        if target is not None:
            check_same_vocabulary(target.tokenizer, model.tokenizer, model.name)
        self.model = model
        self.name = "draft"
        self.target_vocab = target.vocab_size if target is not None else model.vocab_size

    def begin(self, prompt_ids: Sequence[int]) -> ModelDraftState:
        return ModelDraftState(cache=self.model.new_state())

    @torch.inference_mode()
    def propose(self, state: ModelDraftState, context: DraftContext, k: int) -> DraftProposal:
        tokens = context.token_ids
        if k <= 0:
            return DraftProposal.empty()
        common = _common_prefix(state.fed, tokens)
        if common == len(tokens):  # must feed at least one token to get logits
            common -= 1
        self.model.rollback(state.cache, common)
        del state.fed[common:]
        logits = self.model.prefill(state.cache, tokens[common:])  # [vocab]
        state.fed.extend(tokens[common:])
        proposed: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            token, probs = self._pick(logits, context)
            proposed.append(token)
            if probs is not None:
                rows.append(probs)
            if i + 1 < k:
                logits = self.model.prefill(state.cache, [token])
                state.fed.append(token)
        probs_all = torch.stack(rows) if rows else None  # [k, vocab]
        return DraftProposal(tokens=tuple(proposed), probs=probs_all)

    def rollback(self, state: ModelDraftState, length: int) -> None:
        if length < len(state.fed):
            self.model.rollback(state.cache, length)
            del state.fed[length:]

    def release(self, state: ModelDraftState) -> None:
        self.model.rollback(state.cache, 0)
        state.fed.clear()

    def _pick(
        self, logits: torch.Tensor, context: DraftContext  # [vocab]
    ) -> tuple[int, torch.Tensor | None]:
        logits = _fit_vocab(logits, self.target_vocab)
        if context.generator is None:
            return int(logits.argmax().item()), None
        probs = logits_to_probs(logits.unsqueeze(0), context.sampling)[0]  # [vocab]
        token = int(torch.multinomial(probs, 1, generator=context.generator).item())
        return token, probs


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _fit_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:  # [vocab] -> [size]
    """Pad (with -inf) or trim draft logits to the target's vocabulary size."""
    if logits.shape[-1] == size:
        return logits
    if logits.shape[-1] > size:
        return logits[..., :size]
    pad = torch.full((size - logits.shape[-1],), float("-inf"), dtype=logits.dtype)
    return torch.cat([logits, pad.to(logits.device)])
