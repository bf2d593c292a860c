"""A grammar inside the speculative round: the hooks ``SequenceDecoder`` calls
(``RoundConstraint``; a request without a grammar has ``Unconstrained``, whose hooks pass
their input through).

- Drafting: the tokens the grammar forces (keys, punctuation) lead the round's
  draft for free, and the other drafters continue from them; draft tokens the
  grammar forbids are cut before the target pass.
- Scoring: the target's logits are masked at every verified position (the matcher
  steps through the draft to know each position's mask), so greedy verification
  keeps exactly what plain constrained greedy decoding would, and sampling draws
  from the masked, renormalised distribution.
- Committing: the matcher keeps the accepted tokens and the target's own, and rolls
  back the rejected drafts.

A sampled model draft cut at a forbidden token needs one correction to stay exact:
that token would have been rejected for certain, so the target's token there comes
from the residual ``max(0, target - draft)`` rather than from the target alone; the
draft keeps that row (``ConstrainedDraft.cut_row``) and ``verify()`` draws from it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from decoding.constraints import Constraint, Grammar
from decoding.drafter import DraftProposal
from decoding.types import RoundEvent

MAX_FORCED = 32  # grammar-forced draft tokens per round


@dataclasses.dataclass(frozen=True)
class ConstrainedDraft:
    """A round's draft after the grammar: ``forced`` tokens lead it; ``cut_row`` is the
    draft distribution of a sampled token the grammar forbade (cut), if any."""

    proposal: DraftProposal
    forced: int
    cut_row: torch.Tensor | None = None  # [vocab]


class RoundConstraint(Protocol):
    """What a sequence's output rule does in each round: what drafters continue from
    (``context``), the draft as it leaves it (``draft``, at most ``room`` tokens), the
    target's logits at each verified position (``mask``), following the committed output
    (``sync``), and the round's event with its figures (``annotate``)."""

    def context(self, tokens: list[int], output_len: int) -> Sequence[int]: ...
    def draft(self, proposal: DraftProposal, output_len: int, room: int,
              sampled: bool) -> ConstrainedDraft: ...
    def mask(self, logits: torch.Tensor, draft: Sequence[int]) -> torch.Tensor: ...
    def sync(self, output: Sequence[int]) -> None: ...
    def annotate(self, event: RoundEvent, accepted_forced: int) -> RoundEvent: ...


class Unconstrained:
    """No grammar: every hook passes its input through."""

    def context(self, tokens: list[int], output_len: int) -> Sequence[int]:
        return tokens

    def draft(self, proposal: DraftProposal, output_len: int, room: int,
              sampled: bool) -> ConstrainedDraft:
        return ConstrainedDraft(proposal, 0)

    def mask(self, logits: torch.Tensor, draft: Sequence[int]) -> torch.Tensor:
        return logits

    def sync(self, output: Sequence[int]) -> None:
        return None

    def annotate(self, event: RoundEvent, accepted_forced: int) -> RoundEvent:
        return event


class ConstrainedDecoding:
    """One sequence's grammar state across rounds."""

    def __init__(self, grammar: Grammar, stop_ids: frozenset[int], forced_drafts: bool) -> None:
        self.constraint: Constraint = grammar.matcher()
        self.stop_ids = stop_ids
        self.forced_drafts = forced_drafts
        self.consumed: list[int] = []  # output tokens in the matcher: committed, then drafted
        self.committed = 0  # consumed[:committed] is the committed output
        self._forced: tuple[int, list[int]] = (-1, [])  # (output length, forced tokens there)
        self.mask_s = 0.0  # this round's seconds on masks and matching
        self.forced_drafted = 0  # this round's forced drafts

    # -- drafting ---------------------------------------------------------------------

    def forced(self, output_len: int) -> list[int]:
        """The forced tokens after the committed output (computed once per round)."""
        if not self.forced_drafts:
            return []
        if self._forced[0] != output_len:
            start = time.perf_counter()
            self._forced = (output_len, self.constraint.forced()[:MAX_FORCED])
            self.mask_s += time.perf_counter() - start
        return self._forced[1]

    def context(self, tokens: list[int], output_len: int) -> Sequence[int]:
        """What drafters continue from: the committed tokens, then the forced ones."""
        forced = self.forced(output_len)
        return tokens + forced if forced else tokens

    def draft(self, proposal: DraftProposal, output_len: int, room: int,
              sampled: bool) -> ConstrainedDraft:
        """Forced tokens, then the drafter's, cut at the first the grammar forbids and
        after the first stop token; at most ``room`` tokens."""
        start = time.perf_counter()
        forced = self.forced(output_len)
        tokens = [*forced, *proposal.tokens][:room]
        valid = self.constraint.valid_prefix(tokens)
        stop = next((i + 1 for i, t in enumerate(tokens[:valid]) if t in self.stop_ids), valid)
        keep = min(valid, stop)
        n_forced = min(len(forced), keep)
        drafted = keep - n_forced  # the drafter's tokens kept
        probs = proposal.probs
        cut_row = None
        if sampled and probs is not None and keep == valid < len(tokens) and valid >= len(forced):
            cut_row = probs[drafted] if drafted < probs.shape[0] else None
        rows = None
        if probs is not None and keep:
            one_hot = torch.zeros(n_forced, probs.shape[-1], dtype=probs.dtype,
                                  device=probs.device)  # [forced, vocab]
            one_hot[torch.arange(n_forced), torch.tensor(tokens[:n_forced], dtype=torch.long)] = 1
            rows = torch.cat([one_hot, probs[:drafted]])  # [keep, vocab]
        confidence = (1.0,) * n_forced + tuple(proposal.confidence[: drafted + 1])
        self.forced_drafted = n_forced
        self.mask_s += time.perf_counter() - start
        return ConstrainedDraft(DraftProposal(tuple(tokens[:keep]), rows, confidence),
                                n_forced, cut_row)

    # -- scoring ----------------------------------------------------------------------

    def mask(self, logits: torch.Tensor, draft: Sequence[int]) -> torch.Tensor:  # [n, V]
        """``logits`` with the tokens the grammar forbids at each position set to -inf;
        the matcher is left after the draft (``sync`` settles it)."""
        start = time.perf_counter()
        rows = []
        for i in range(logits.shape[0]):
            rows.append(self.constraint.allowed())
            if i < len(draft):
                if draft[i] in self.stop_ids and self.constraint.is_terminated():
                    continue  # the answer is complete: a stop token ends it (see sync)
                if not self.constraint.advance([draft[i]]):
                    raise RuntimeError("a draft token the grammar forbids reached scoring")
                self.consumed.append(int(draft[i]))
        allowed = torch.stack(rows).to(logits.device)  # [n, vocab]
        if allowed.shape[-1] < logits.shape[-1]:  # logits wider than the tokenizer
            pad = torch.zeros(allowed.shape[0], logits.shape[-1] - allowed.shape[-1],
                              dtype=torch.bool, device=logits.device)
            allowed = torch.cat([allowed, pad], dim=-1)
        masked = logits.masked_fill(~allowed[:, : logits.shape[-1]], float("-inf"))
        self.mask_s += time.perf_counter() - start
        return masked

    # -- committing -------------------------------------------------------------------

    def sync(self, output: Sequence[int]) -> None:
        """Bring the matcher to the committed output: roll back the rejected drafts,
        consume the accepted and the target's tokens."""
        start = time.perf_counter()
        common = self.committed
        limit = min(len(self.consumed), len(output))
        while common < limit and self.consumed[common] == output[common]:
            common += 1
        self.constraint.rollback(len(self.consumed) - common)
        del self.consumed[common:]
        rest = [int(t) for t in output[common:]]
        if rest and self.constraint.advance(rest):
            self.consumed.extend(rest)
        elif rest:  # only a final stop token outside the grammar: the sequence ends
            valid = self.constraint.valid_prefix(rest)
            self.constraint.advance(rest[:valid])
            self.consumed.extend(rest[:valid])
        self.committed = len(self.consumed)
        self.mask_s += time.perf_counter() - start

    def annotate(self, event: RoundEvent, accepted_forced: int) -> RoundEvent:
        """The round's event with its grammar figures; resets them for the next round."""
        event = dataclasses.replace(event, constraint_s=self.mask_s,
                                    forced_tokens=self.forced_drafted,
                                    forced_accepted=accepted_forced)
        self.mask_s = 0.0
        self.forced_drafted = 0
        return event
