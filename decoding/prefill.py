"""A sequence's prompt on its way into the target's cache, and its use of the prefix cache.

The prompt starts after the longest prefix that running sequences hold in the target's
shared KV blocks, or else the prefix cache holds (``decoding.prefix_use``), then
runs in chunks; their seconds and, when asked for, the prompt's log-probabilities are kept
as they come. The prompt's own blocks are stored once its first token is out (not before:
the first token should not wait on the cache), and what followed the prompt is remembered
when the output ends at a stop or the length cap.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from decoding.logprobs import PromptLogprobs
from decoding.prefix_cache import PrefixCache
from decoding.prefix_use import load_prefix, remember_continuation, store_prefix
from decoding.target import StateT, Target
from decoding.types import FinishReason, PromptChunk, TokenLogprob

_REMEMBERED = (FinishReason.STOP, FinishReason.LENGTH)


class PromptPrefill:
    def __init__(self, prompt_ids: Sequence[int], cache: PrefixCache | None,
                 top_logprobs: int | None = None) -> None:
        """``top_logprobs``: the prompt's log-probabilities are asked for, with this many
        alternatives (None: not asked for)."""
        self.prompt_ids = prompt_ids
        self.cache = cache
        self.logprobs = None if top_logprobs is None else PromptLogprobs(prompt_ids, top_logprobs)
        self.cached_tokens = 0  # prompt tokens whose KV came from the cache
        self.seconds = 0.0  # the prompt's passes
        self.started = 0.0  # when its first chunk was asked for (perf_counter)
        self._prefilled: int | None = None  # prompt tokens in the target's cache
        self._store_pending = cache is not None

    @property
    def prefilled(self) -> int:
        """Prompt tokens in the target's cache."""
        return self._prefilled or 0

    def next_chunk(self, target: Target[StateT], state: StateT, limit: int = 0) -> PromptChunk:
        """The next at most ``limit`` prompt tokens to prefill (0: all the rest). The first
        call shares the blocks of the longest prefix other sequences of the target
        published, else loads the longest prefix the cache holds into ``state`` (neither
        when the prompt's log-probabilities are asked for: a cached position's logits
        were never computed)."""
        if self._prefilled is None:
            self.started = time.perf_counter()
            if self.logprobs is None:
                shared = target.share_prefix(state, self.prompt_ids)
                self.cached_tokens = shared or load_prefix(self.cache, target, state,
                                                           self.prompt_ids)
            self._prefilled = self.cached_tokens
        rest = self.prompt_ids[self._prefilled :]
        chunk = rest[:limit] if limit else rest
        return PromptChunk(chunk, final=len(chunk) == len(rest))

    def kept_rows(self, chunk: PromptChunk) -> int:
        """The rows of logits a chunk's pass keeps: every token's when the prompt's
        log-probabilities are asked for, else the last token's of the prompt's last chunk."""
        return len(chunk.tokens) if self.logprobs is not None else 1 if chunk.final else 0

    def done(self, chunk: PromptChunk, seconds: float,
             logits: torch.Tensor,  # [kept_rows(chunk), vocab] raw target logits
             ) -> None:
        """A chunk's pass ran in ``seconds``."""
        assert self._prefilled is not None, "no chunk was asked for"
        if self.logprobs is not None:
            self.logprobs.add(self._prefilled, len(chunk.tokens), logits)
        self._prefilled += len(chunk.tokens)
        self.seconds += seconds

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The prompt's log-probabilities scored so far, once (for the first event)."""
        return self.logprobs.take() if self.logprobs is not None else ()

    def store(self, target: Target[StateT], state: StateT) -> None:
        """Store the prompt's blocks that did not come from the cache (once)."""
        if self._store_pending:
            self._store_pending = False
            assert self.cache is not None
            store_prefix(self.cache, target, state, self.prompt_ids, self.cached_tokens)

    def ended(self, target: Target[StateT], state: StateT, tokens: Sequence[int],
              reason: FinishReason) -> None:
        """The output ended: the prompt's blocks stored if they were not yet, and, after a
        stop or the length cap, what followed the prompt (``tokens``: prompt and output)
        remembered for continuation drafts."""
        self.store(target, state)
        if self.cache is not None and reason in _REMEMBERED:
            remember_continuation(self.cache, tokens, len(self.prompt_ids))
