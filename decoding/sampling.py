"""Turning raw logits into the distribution a request samples from.

The target's logits at every verified position go through these transforms, so
temperature, top-k, top-p and the OpenAI penalties are honoured exactly under
speculation. A model drafter applies temperature, top-k and top-p to its own logits;
its distribution need not match the target's for the output to be exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decoding.types import SamplingParams


def output_counts(token_ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in ``token_ids``.  # [vocab]"""
    counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    if token_ids:
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
        counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts


def apply_penalties(
    logits: torch.Tensor,  # [n, vocab]
    counts: torch.Tensor,  # [vocab] output-token counts before position 0
    draft_tokens: Sequence[int],  # [n - 1] tokens assumed emitted before positions 1..n-1
    params: SamplingParams,
) -> torch.Tensor:  # [n, vocab]
    """OpenAI presence/frequency penalties, position by position.

    Position i is scored as if ``draft_tokens[:i]`` had already been emitted, so
    the penalised distribution at every position is the one plain decoding
    would have used there.
    """
    if not params.has_penalties:
        return logits
    n, vocab = logits.shape
    per_position = counts.unsqueeze(0).expand(n, vocab).clone()  # [n, vocab]
    for i, token in enumerate(draft_tokens[: n - 1]):
        per_position[i + 1 :, token] += 1.0
    penalty = params.frequency_penalty * per_position
    penalty = penalty + params.presence_penalty * (per_position > 0).to(logits.dtype)
    return logits - penalty.to(logits.dtype)


def logits_to_probs(
    logits: torch.Tensor,  # [n, vocab]
    params: SamplingParams,
) -> torch.Tensor:  # [n, vocab]
    """Temperature, then top-k, then top-p, then softmax (float32)."""
    scores = logits.float() / max(params.temperature, 1e-5)
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A per-request generator: seeded requests are reproducible."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
