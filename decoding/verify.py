"""Verification of draft tokens against the target: the heart of speculation.

Leviathan, Kalman and Matias, "Fast Inference from Transformers via Speculative
Decoding", ICML 2023 (arXiv 2211.17192), Algorithm 1. Vocabulary follows vLLM:
a draft token is *accepted* or rejected; on rejection the next token is
*recovered* by sampling the residual distribution; when every draft token is
accepted the target contributes one *bonus* token. The acceptance length of a
round therefore includes that final token.

Greedy, a round may also verify an *alternative*: a second candidate for the first
draft position, run as a branch of a two-token tree (it sees the cache and the
pending token only). When the target rejects the first draft token for exactly the
alternative, the alternative and the target's token after it are kept.

Sampling is keyed by default: the target's token at each position is drawn with
noise fixed by (seed, choice, position) (``SamplingKey``), and a draft token is
accepted exactly when it equals that draw. Each token is still an exact sample
of the target's distribution given the prefix, and the text no longer depends on
the drafter. Rejection sampling with a generator (Algorithm 1) remains for
requests that ask for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from decoding.sampling import Randomness, SamplingKey

ArgmaxRows = Callable[[torch.Tensor], list[int]]  # [n, vocab] -> each row's first largest


def widened_argmax(scores: torch.Tensor) -> list[int]:
    """Each row's first largest score's index, in float32 (``Target.first_largest``
    makes the same picks on a runner's own kernels)."""
    best: list[int] = scores.float().argmax(dim=-1).tolist()
    return best


@dataclass(frozen=True)
class Verdict:
    accepted: int  # how many draft tokens were kept (a prefix of the draft)
    next_token: int  # recovered (after a rejection) or bonus (all accepted), or the
    # alternative when it was taken
    bonus: bool  # True when next_token is the bonus token
    alternative_taken: bool = False  # the alternative replaced the first draft token
    after_alternative: int | None = None  # then: the target's token after it

    def committed(self, draft_tokens: Sequence[int]) -> list[int]:
        """The tokens this round adds to the sequence."""
        if self.alternative_taken:
            assert self.after_alternative is not None
            return [self.next_token, self.after_alternative]
        return [*draft_tokens[: self.accepted], self.next_token]


def verify(
    draft_tokens: Sequence[int],  # [k]
    draft_probs: torch.Tensor | None,  # [k, vocab]; None for a deterministic drafter
    target_probs: torch.Tensor,  # [k + 1, vocab], with or without an alternative
    generator: Randomness | None,
    position: int = 0,  # the absolute position of target_probs[0]'s token (keyed only)
    alternative: int | None = None,  # greedy only: a second candidate for draft[0]
    after_alternative: torch.Tensor | None = None,  # [vocab]: the target's scores after it
    cut_probs: torch.Tensor | None = None,  # [vocab]: the draft's row a grammar cut (below)
    first_largest: ArgmaxRows = widened_argmax,  # greedy's pick (the target's, on its kernels)
) -> Verdict:
    """Keep the longest acceptable prefix of the draft, plus one target token.

    With ``generator=None`` decoding is greedy: a draft token is accepted while
    it equals the target's argmax, so any monotone transform of the target's
    probabilities (its processed logits) may be passed. The result is then
    exactly the token sequence plain greedy decoding produces.

    With a ``SamplingKey`` the target's token at row i is its keyed draw at
    ``position + i`` (argmax of target_probs[i] / E, E exponential noise fixed by the
    key): a draft token is accepted while it equals that draw, and the first
    mismatch, or the bonus, is the draw itself. ``draft_probs`` is not needed; the
    tokens are those plain decoding with the same key produces, whatever was drafted.

    With a generator this is rejection sampling: draft token x at position i is
    accepted with probability min(1, target_probs[i, x] / draft_probs[i, x]);
    after the first rejection the next token is drawn from the residual
    max(0, target_probs[i] - draft_probs[i]), renormalised. The output then has
    exactly the target's distribution. ``draft_probs=None`` stands for a
    deterministic drafter (a one-hot distribution on each proposed token).

    ``alternative`` (greedy only, with a draft) and ``after_alternative``, the target's
    scores after it: the alternative is taken when the target's choice for the first
    position is the alternative (the Verdict says so).

    ``cut_probs`` (rejection sampling only): the draft distribution of the token after
    the draft, which a grammar forbade and cut. That token would have been rejected for
    certain, so when every kept draft token is accepted the next one is drawn from the
    residual ``max(0, target_probs[k] - cut_probs)``, not from ``target_probs[k]``.

    ``first_largest`` (greedy only) makes the target's picks: any function with
    ``widened_argmax``'s results, such as the target's own (``Target.first_largest``).
    """
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows for {k} draft tokens")
    if (alternative is None) != (after_alternative is None):
        raise ValueError("an alternative is verified with the target's scores after it")
    if alternative is not None and (generator is not None or k == 0):
        raise ValueError("an alternative is verified only greedily, beside a draft")
    if generator is None:
        return _verify_greedy(draft_tokens, target_probs, alternative, after_alternative,
                              first_largest)
    if isinstance(generator, SamplingKey):  # its draws do not depend on the draft: no cut
        return _verify_keyed(draft_tokens, target_probs, generator, position)
    return _verify_sampled(draft_tokens, draft_probs, target_probs, generator, cut_probs)


def _verify_greedy(draft_tokens: Sequence[int],
                   target_scores: torch.Tensor,  # [k + 1, vocab]
                   alternative: int | None,
                   after_alternative: torch.Tensor | None,  # [vocab]
                   first_largest: ArgmaxRows,
                   ) -> Verdict:
    best = first_largest(target_scores)  # torch's argmax of the widened rows (same ties)
    if after_alternative is not None:  # its row last: k + 2 picks
        best += first_largest(after_alternative[None])
    k = len(draft_tokens)
    if alternative is not None and best[0] == alternative != draft_tokens[0]:
        return Verdict(accepted=0, next_token=alternative, bonus=False,
                       alternative_taken=True, after_alternative=best[k + 1])
    for i, token in enumerate(draft_tokens):
        if token != best[i]:
            return Verdict(accepted=i, next_token=best[i], bonus=False)
    return Verdict(accepted=k, next_token=best[k], bonus=True)


def _verify_keyed(
    draft_tokens: Sequence[int],  # [k]
    target_probs: torch.Tensor,  # [k + 1, vocab]
    key: SamplingKey,
    position: int,
) -> Verdict:
    for i, token in enumerate(draft_tokens):  # draws made lazily: each costs a noise row
        drawn = key.draw(target_probs[i], position + i)
        if token != drawn:
            return Verdict(accepted=i, next_token=drawn, bonus=False)
    k = len(draft_tokens)
    return Verdict(accepted=k, next_token=key.draw(target_probs[k], position + k), bonus=True)


def _verify_sampled(
    draft_tokens: Sequence[int],  # [k]
    draft_probs: torch.Tensor | None,  # [k, vocab]
    target_probs: torch.Tensor,  # [k + 1, vocab]
    generator: torch.Generator,
    cut_probs: torch.Tensor | None,  # [vocab]
) -> Verdict:
    k = len(draft_tokens)
    if k:
        index = torch.tensor(list(draft_tokens), dtype=torch.long, device=target_probs.device)
        rows = torch.arange(k, device=target_probs.device)
        p_target = target_probs[rows, index]  # [k]
        if draft_probs is None:
            p_draft = torch.ones_like(p_target)
        else:
            p_draft = draft_probs[rows, index].to(p_target.dtype)  # [k]
        ratio = (p_target / p_draft.clamp_min(1e-30)).clamp(max=1.0)  # [k]
        uniform = torch.rand(k, generator=generator, device=target_probs.device)  # [k]
        rejected = (uniform >= ratio).tolist()
        for i in range(k):
            if rejected[i]:
                residual = _residual(target_probs[i],
                                     None if draft_probs is None else draft_probs[i],
                                     draft_tokens[i])
                token = int(torch.multinomial(residual, 1, generator=generator).item())
                return Verdict(accepted=i, next_token=token, bonus=False)
    if cut_probs is not None:  # the cut token's rejection: recovered from the residual
        residual = _residual(target_probs[k], cut_probs, -1)
        token = int(torch.multinomial(residual, 1, generator=generator).item())
        return Verdict(accepted=k, next_token=token, bonus=False)
    token = int(torch.multinomial(target_probs[k], 1, generator=generator).item())
    return Verdict(accepted=k, next_token=token, bonus=True)


def _residual(
    target_row: torch.Tensor,  # [vocab]
    draft_row: torch.Tensor | None,  # [vocab]; None: one-hot on draft_token
    draft_token: int,
) -> torch.Tensor:  # [vocab]
    """max(0, target - draft), renormalised; the target itself if that is empty."""
    if draft_row is None:
        residual = target_row.clone()
        residual[draft_token] = 0.0
    else:
        residual = (target_row - draft_row.to(target_row.dtype)).clamp_min(0.0)
    total = residual.sum()
    if not torch.isfinite(total) or total.item() <= 0.0:
        return target_row
    return residual / total
