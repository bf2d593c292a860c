"""A sequence's use of the prefix cache: load the longest cached prompt prefix into its
KV, store its prompt's blocks, remember its continuation. A failure is a miss and an
error count, never a failed request."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from decoding.prefix_cache import PrefixCache
from decoding.target import StateT, Target

log = logging.getLogger(__name__)


def load_prefix(cache: PrefixCache | None, target: Target[StateT], state: StateT,
                prompt_ids: Sequence[int]) -> int:
    """Reuse the KV of the longest cached prefix of ``prompt_ids``; the tokens reused."""
    if cache is None:
        return 0
    try:
        hit = cache.lookup(prompt_ids, target.num_layers)
        if hit is None:
            return 0
        target.load_kv(state, hit.kv)
        return hit.tokens
    except Exception:
        log.exception("prefix cache lookup failed; prefilling the whole prompt")
        cache.stats.add(errors=1)
        target.rollback(state, 0)
        return 0


def store_prefix(cache: PrefixCache, target: Target[StateT], state: StateT,
                 prompt_ids: Sequence[int], cached_tokens: int) -> None:
    """Store the prompt's blocks that did not come from the cache."""
    try:
        cache.store_prefix(prompt_ids, target.kv(state),
                           skip_blocks=cached_tokens // cache.block_tokens)
    except Exception:
        log.exception("storing the prompt's KV failed")
        cache.stats.add(errors=1)


def remember_continuation(cache: PrefixCache, tokens: Sequence[int], start: int) -> None:
    """Remember what followed the prompt, for continuation drafts of a repeated request."""
    try:
        cache.remember(tokens, start=start)
    except Exception:
        log.exception("remembering the continuation failed")
        cache.stats.add(errors=1)
