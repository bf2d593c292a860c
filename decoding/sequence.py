"""One request's state across speculative rounds: its KV cache, sampling randomness and
grammar, and the parts it holds: the committed tokens, their text and stop state
(``text.Committed``), the prompt's prefill and prefix-cache use (``prefill.PromptPrefill``),
and the drafting (``drafting.SequenceDrafting``: the drafter, its sources' draft-length
policies and the target's feature rows).

The round itself is ``decoding.round.speculative_round``; this class offers it the
steps it needs for one sequence (the next prompt chunk, a draft, the pass's tokens, the
processed scores, keeping what verification kept, committing), each small.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Generic

import torch

from decoding.constrained import ConstrainedDecoding, RoundConstraint, Unconstrained
from decoding.drafter import DraftContext, Drafter, DraftProposal
from decoding.drafting import Draft, SequenceDrafting
from decoding.features import FeatureRows
from decoding.logprobs import token_logprobs
from decoding.policy import AdaptiveSpeculation
from decoding.prefill import PromptPrefill
from decoding.prefix_cache import PrefixCache
from decoding.sampling import apply_penalties, logits_to_probs, make_randomness, output_counts
from decoding.target import StateT, Target
from decoding.text import Committed
from decoding.types import (
    FinishReason,
    GenerationRequest,
    PromptChunk,
    RoundEvent,
    RoundTiming,
)
from decoding.verify import Verdict, verify
from runtime.runner.passes import BatchItem

log = logging.getLogger(__name__)


class ContextOverflowError(ValueError):
    """The prompt leaves no room to generate within the model's context."""


class SequenceDecoder(Generic[StateT]):
    def __init__(
        self,
        target: Target[StateT],
        drafter: Drafter | None,
        request: GenerationRequest,
        policy: AdaptiveSpeculation | None = None,
        prefix_cache: PrefixCache | None = None,
        new_policy: Callable[[str], AdaptiveSpeculation] | None = None,
    ) -> None:
        """``policy``: one draft-length policy for every source of the drafter; else
        each source gets its own from ``new_policy(source)`` (default: a fresh one)."""
        prompt_len = len(request.prompt_ids)
        if prompt_len >= target.max_context:
            raise ContextOverflowError(
                f"the prompt has {prompt_len} tokens; the model's context is {target.max_context}"
            )
        self.target = target
        self.request = request
        self.params = request.sampling
        # Sampling randomness: keyed by (seed, choice, position), or rejection sampling's
        # generator; verify() is told each round's first position.
        self.generator = make_randomness(self.params, target.device)
        stop_ids = target.eos_token_ids | frozenset(request.stop_token_ids)
        self.committed = Committed(target.tokenizer, request.prompt_ids, stop_ids,
                                   min(request.max_new_tokens, target.max_context - prompt_len),
                                   request.stop)
        self.prompt = self._prompt_prefill(prefix_cache)
        self.state: StateT | None = target.new_state()  # None once closed
        self.rounds = 0
        # after a preemption: the tokens whose KV is computed again before the next round
        # (all it had committed but the pending last one); None: none to compute
        self._recompute: Sequence[int] | None = None
        self._counts: torch.Tensor | None = None  # output token counts, for penalties
        spec = request.speculation  # a grammar the output must match (decoding/constrained.py)
        self.grammar: RoundConstraint = Unconstrained() if request.grammar is None else (
            ConstrainedDecoding(request.grammar, stop_ids,
                                spec.enabled and spec.drafter != "none"))
        # greedy decoding without penalties (a penalised or sampled row after the alternative
        # would need counts and a distribution of their own), on a target that runs token
        # trees: a round may verify an alternative for its first draft token
        alternatives = (self.generator is None and not self.params.has_penalties
                        and target.capabilities.branches and request.grammar is None)
        self.drafting = None if drafter is None or not spec.enabled else SequenceDrafting(
            drafter, request.prompt_ids, alternatives,
            drafter.reads_features and target.capabilities.features,
            policy, new_policy, spec.max_draft_tokens)

    @property
    def finished(self) -> bool:
        return self.committed.finished

    @property
    def live_state(self) -> StateT:
        """The target's state of this sequence (not yet closed)."""
        if self.state is None:
            raise RuntimeError("the sequence is closed")
        return self.state

    @property
    def features(self) -> FeatureRows | None:
        """The target's hidden states by position, for a drafter that reads them."""
        return self.drafting.features if self.drafting is not None else None

    def choose_source(self) -> None:
        """Let the drafter say which of its sources drafts the next round (once per
        round); ``drafting.policy`` is then that source's."""
        if self.drafting is not None and self.rounds > 0:
            self.drafting.choose_source(self.rounds, self.draft_context)

    def _prompt_prefill(self, cache: PrefixCache | None) -> PromptPrefill:
        request = self.request
        return PromptPrefill(request.prompt_ids, cache,
                             request.top_logprobs if request.prompt_logprobs else None)

    @property
    def prefilling(self) -> bool:
        """Its prompt, or after a preemption what it had committed, is not all in the
        target's cache yet."""
        return self.rounds == 0 or self._recompute is not None

    @property
    def prefill_left(self) -> int:
        """The tokens still to go into the target's cache before it decodes."""
        if self._recompute is not None:
            return len(self._recompute) - self.live_state.length
        return len(self.request.prompt_ids) - self.prompt.prefilled

    @property
    def held_positions(self) -> int:
        """The positions it needs in the target's cache to decode: its prompt and what it
        has committed."""
        return max(len(self.request.prompt_ids), len(self.committed.tokens) - 1)

    def pass_tokens(self, k: int) -> int:
        """The most tokens the next round's pass takes with a draft of ``k``: the pending
        token, the grammar's forced tokens and ``k`` drafted (within the answer's room),
        and an alternative."""
        tokens = self.committed.tokens
        forced = len(self.grammar.context(tokens, len(self.committed.output))) - len(tokens)
        return 2 + min(forced + k, max(0, self.committed.remaining - 1))

    def next_prompt_chunk(self, limit: int = 0) -> PromptChunk:
        """The next at most ``limit`` prompt tokens to prefill (0: all the rest), after
        the longest cached prefix (``PromptPrefill.next_chunk``); after a preemption, the
        next of the tokens it had, after the blocks other sequences still share."""
        if self._recompute is not None:
            state = self.live_state
            if state.length == 0:
                self.target.share_prefix(state, self._recompute)
            rest = self._recompute[state.length :]
            chunk = rest[:limit] if limit else rest
            return PromptChunk(chunk, final=len(chunk) == len(rest), recompute=True)
        if self.finished or self.rounds:
            raise RuntimeError("the prompt has been prefilled")
        return self.prompt.next_chunk(self.target, self.live_state, limit)

    def suspend(self) -> None:
        """Preempted: give the target's cache back; its next prompt chunks compute it again
        (``next_prompt_chunk``). Its committed tokens, sampling state, grammar and drafter
        stay as they are, so the answer goes on exactly as it would have."""
        if self.state is None:
            raise RuntimeError("the sequence is closed")
        self.target.release(self.state)
        self.state = self.target.new_state()
        if self.rounds == 0:  # its prompt from the start (nothing of it went out)
            self.prompt = self._prompt_prefill(self.prompt.cache)
        else:
            self._recompute = tuple(self.committed.tokens[:-1])

    def store_prompt(self) -> None:
        """The prompt's KV blocks into the prefix cache, once (the round after the first
        token went out, so that storing never delays it; a failure is logged, not raised)."""
        self.prompt.store(self.target, self.live_state)

    def propose(self, k: int, made: tuple[DraftProposal, float] | None = None) -> Draft:
        """This round's draft of at most ``k`` tokens, or ``made`` (a proposal drafted with
        other sequences' in one batch, and its share of that batch's seconds)."""
        if self.finished:
            raise RuntimeError("the sequence has already finished")
        start = time.perf_counter()
        if made is None:
            began = time.perf_counter()
            proposal = self._propose(k)
            made = (proposal, time.perf_counter() - began)
        proposal, seconds = made
        remaining = self.committed.remaining
        # a grammar's forced drafts lead, and the draft tokens it forbids are cut
        constrained = self.grammar.draft(proposal, len(self.committed.output),
                                         max(0, remaining - 1),
                                         sampled=self.generator is not None)
        proposal = constrained.proposal
        tokens = tuple(proposal.tokens[: max(0, remaining - 1)])
        policy, alternative = None, None
        if self.drafting is not None:
            policy = self.drafting.policy
            if tokens and len(tokens) < policy.max_tokens and self.drafting.alternatives:
                alternative = proposal.alternative  # a draft token too: within the round's cap
        probs = proposal.probs[: len(tokens)] if proposal.probs is not None else None
        expected = policy.expected_tokens(len(tokens)) if policy is not None and tokens else []
        return Draft(tokens, probs, alternative, proposal, seconds, start, policy,
                     expected[-1] - 1.0 if expected else None, constrained)

    def pass_item(self, part: PromptChunk | Draft) -> BatchItem[StateT]:
        """What the target runs for this sequence: a prompt chunk (keeping the logits
        ``PromptPrefill.kept_rows`` says), or the pending token, the draft and (last) the
        alternative."""
        features = self.features is not None
        if isinstance(part, PromptChunk):
            return BatchItem(self.live_state, part.tokens,
                             0 if part.recompute else self.prompt.kept_rows(part),
                             features=features)
        tokens = [self.committed.tokens[-1], *part.tokens]
        if part.alternative is not None:
            tokens.append(part.alternative)
        return BatchItem(self.live_state, tokens, len(tokens),
                         alternative=part.alternative is not None,
                         features=features)

    def prompt_done(self, chunk: PromptChunk, logits: torch.Tensor, forward_s: float,
                    features: torch.Tensor | None = None,  # [n, H]
                    ) -> RoundEvent | None:
        """After a prompt chunk's pass (``logits``: the rows ``pass_item`` kept): nothing
        yet, or (the last chunk) the first token."""
        if chunk.recompute:
            if self.features is not None and features is not None:
                self.features.add(self.live_state.length - len(chunk.tokens), features)
            if chunk.final:
                self._recompute = None
            return None
        if self.features is not None and features is not None:
            self.features.add(self.prompt.prefilled, features)
        self.prompt.done(chunk, forward_s, logits)
        self.target.publish_prefix(self.live_state,
                                   self.request.prompt_ids[: self.prompt.prefilled])
        if not chunk.final:
            return None
        last = logits[-1:]  # [1, vocab]: the first new token's
        token = verify((), None, self.process(last, ()), self.generator,
                       len(self.committed.tokens),
                       first_largest=self.target.first_largest).next_token
        return self.commit([token], 0, 0, last, RoundTiming(0.0, self.prompt.seconds, 0.0),
                           self.prompt.started)

    def roll_back(self, verdict: Verdict, passed: int,
             features: torch.Tensor | None = None,  # [passed, H]
             ) -> None:
        """Roll the target's cache back to what verification kept of a pass of ``passed``
        tokens (pending, drafts, then any alternative), and keep the kept tokens'
        ``features``."""
        pending = len(self.committed.tokens) - 1  # the pending token's position
        if verdict.alternative_taken:
            self.target.adopt_alternative(self.live_state, pending, passed)
        else:
            self.target.rollback(self.live_state, len(self.committed.tokens) + verdict.accepted)
        if self.features is not None and features is not None:
            self.features.add_verified(pending, features, verdict.accepted,
                                       verdict.alternative_taken)

    def undo(self, part: PromptChunk | Draft) -> None:
        """Forget a pass that failed: the cache as it was."""
        if self.state is None:
            return
        if isinstance(part, PromptChunk):  # (a recomputed chunk's pass left the length)
            committed = self.state.length if part.recompute else self.prompt.prefilled
        else:
            committed = len(self.committed.tokens)
        self.target.rollback(self.state, committed)

    def failed(self, error: str) -> RoundEvent:
        """The final event of a sequence that failed (its caches freed)."""
        self.close()
        self.committed.finish_reason = FinishReason.ERROR
        return self.final_event(FinishReason.ERROR, error)

    def final_event(self, reason: FinishReason, error: str | None = None) -> RoundEvent:
        """An event that ends the sequence without new tokens (timeout, error,
        cancellation); a timeout keeps the text held back so far."""
        return RoundEvent(
            token_ids=(), text=self.committed.flush() if reason is FinishReason.TIMEOUT else "",
            draft_tokens=0, accepted_tokens=0, finish_reason=reason, timing=RoundTiming(),
            round_index=self.rounds, prompt_tokens=len(self.request.prompt_ids),
            completion_tokens=len(self.committed.output), error=error)

    def draft_length(self, k: int | None = None) -> int:
        """How many tokens to draft next round: ``k`` (``None``: the policy's choice),
        never past ``max_tokens``. Asking the policy counts as its decision."""
        remaining = self.committed.remaining
        if self.drafting is None:
            return 0
        if k is None:
            self.choose_source()
            k = self.drafting.policy.next_k(remaining - 1)
        return max(0, min(k, remaining - 1))

    def draft_context(self) -> DraftContext:
        tokens = self.grammar.context(self.committed.tokens,  # then a grammar's forced ones
                                      len(self.committed.output))
        return DraftContext(tokens, self.params, self.generator, judge=self.drafting,
                            features=self.features)

    def close(self) -> None:
        """Free the KV caches (idempotent)."""
        if self.state is not None:
            self.target.release(self.state)
            self.state = None
        if self.drafting is not None:
            self.drafting.release()

    def _propose(self, k: int) -> DraftProposal:
        if self.drafting is None or k <= 0:
            return DraftProposal.empty()
        return self.drafting.propose(self.draft_context(), k)

    def process(self, logits: torch.Tensor, draft: Sequence[int]) -> torch.Tensor:  # [n, V]
        """The grammar's mask, penalties, then (when sampling) temperature/top-k/top-p
        into probabilities."""
        logits = self.grammar.mask(logits, draft)  # at every verified position
        if self.params.has_penalties:
            if self._counts is None:
                self._counts = output_counts(self.committed.output, logits.shape[-1],
                                             logits.device)
            logits = apply_penalties(logits, self._counts, draft, self.params)
        if self.generator is None:
            return logits
        return logits_to_probs(logits, self.params)

    def commit(
        self,
        new: list[int],
        drafted: int,
        accepted: int,
        logits: torch.Tensor,  # [>= len(new), V] raw target logits behind each new token
        timing: RoundTiming,
        start: float,
    ) -> RoundEvent:
        new, delta = self.committed.add(new)  # up to a stop token, stop string or the cap
        self.grammar.sync(self.committed.output)  # keep the committed, drop the rejected
        if self._counts is not None:
            for token in new:
                self._counts[token] += 1
        if self.drafting is not None:
            self.drafting.rollback(len(self.committed.tokens))
        finish = self.committed.finish_reason
        logprobs = (token_logprobs(new, logits, self.request.top_logprobs)
                    if self.request.logprobs else ())
        self.rounds += 1
        if finish is not None:
            self.prompt.ended(self.target, self.live_state, self.committed.tokens, finish)
            self.close()
        bookkeeping = time.perf_counter() - start - timing.draft_s - timing.verify_s
        return RoundEvent(
            token_ids=tuple(new),
            text=delta,
            draft_tokens=drafted,
            accepted_tokens=min(accepted, len(new)),
            logprobs=logprobs,
            finish_reason=finish,
            timing=RoundTiming(timing.draft_s, timing.verify_s, max(0.0, bookkeeping)),
            round_index=self.rounds - 1,
            prompt_tokens=len(self.request.prompt_ids),
            completion_tokens=len(self.committed.output),
            cached_tokens=self.prompt.cached_tokens if self.rounds == 1 else 0,
            prompt_logprobs=self.prompt.take_logprobs(),
            draft_source=(self.drafting.source_name if drafted and self.drafting is not None
                          else ""),
        )
