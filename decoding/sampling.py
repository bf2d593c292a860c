"""Turning raw logits into the distribution a request samples from.

The target's logits at every verified position go through these transforms, so
temperature, top-k, top-p and the OpenAI penalties are honoured exactly under
speculation. A model drafter applies temperature, top-k and top-p to its own logits;
its distribution need not match the target's for the output to be exact.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
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
        generator.manual_seed(seed % SEED_MODULUS)
    return generator


SEED_MODULUS = 1 << 64
CACHED_POSITIONS = 32  # noise rows a key keeps: a round's drafts, its verification, the next


class SamplingKey:
    """Randomness keyed by position: the noise behind the token at absolute position t
    of choice c is a pure function of (seed, c, t), so nothing drafted or drawn before
    can change it. One Exp(1) variate per vocabulary entry, from a generator seeded by
    numpy's SeedSequence hash of (seed, c, t); recent rows are cached (drafts and their
    verification ask for the same positions)."""

    def __init__(self, seed: int | None = None, choice: int = 0) -> None:
        self.seed = secrets.randbits(63) if seed is None else seed % SEED_MODULUS
        self.choice = choice
        self._rows: dict[tuple[int, int], torch.Tensor] = {}

    def exponentials(self, position: int, vocab: int) -> torch.Tensor:  # [vocab], CPU
        key = (position, vocab)
        row = self._rows.get(key)
        if row is None:
            rng = np.random.default_rng([self.seed, self.choice, position])
            draws = rng.standard_exponential(vocab, dtype=np.float32)
            # A zero would make probs / noise 0/0 (NaN, which argmax takes) for a token
            # the distribution forbids.
            row = torch.from_numpy(np.maximum(draws, np.float32(1e-30)))
            self._rows[key] = row
            while len(self._rows) > CACHED_POSITIONS:  # positions only move forward
                del self._rows[min(self._rows)]
        return row

    def draw(
        self,
        probs: torch.Tensor,  # [vocab]
        position: int,
    ) -> int:
        """The token at ``position``: argmax(probs / E), E ~ Exp(1) i.i.d. per token (the
        exponential race, i.e. Gumbel-max), an exact sample of ``probs``."""
        noise = self.exponentials(position, probs.shape[-1]).to(probs.device)
        return int((probs.float() / noise).argmax().item())


Randomness = torch.Generator | SamplingKey  # rejection sampling's stream, or keyed noise


def make_randomness(params: SamplingParams, device: torch.device) -> Randomness | None:
    """A request's randomness: None when greedy; keyed by position unless the request
    asks for rejection sampling with a generator (the seed and choice both seed it)."""
    if params.greedy:
        return None
    if params.keyed:
        return SamplingKey(params.seed, params.choice)
    seed = None if params.seed is None else params.seed + params.choice
    return make_generator(seed, device)
