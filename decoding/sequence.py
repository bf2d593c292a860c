"""One request's state across speculative rounds: its tokens, KV caches, drafter state,
draft-length policies, text stream and prefix-cache use.

The round itself is ``decoding.round.speculative_round``; this class offers it the
steps it needs for one sequence (the next prompt chunk, a draft, the pass's tokens, the
processed scores, keeping what verification kept, committing), each small.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from decoding.constrained import ConstrainedDecoding
from decoding.drafters.base import DraftContext, Drafter, DraftProposal
from decoding.drafting import Draft
from decoding.features import FeatureRows
from decoding.logprobs import PromptLogprobs, token_logprobs
from decoding.policy import AdaptiveSpeculation
from decoding.prefix_cache import PrefixCache
from decoding.prefix_use import load_prefix, remember_continuation, store_prefix
from decoding.sampling import apply_penalties, logits_to_probs, make_randomness, output_counts
from decoding.target import Target
from decoding.text import TextStream
from decoding.types import (
    FinishReason,
    GenerationRequest,
    PromptChunk,
    RoundEvent,
    RoundTiming,
)
from decoding.verify import Verdict, verify
from runtime.passes import BatchItem

log = logging.getLogger(__name__)


_REMEMBERED = (FinishReason.STOP, FinishReason.LENGTH)


class ContextOverflowError(ValueError):
    """The prompt leaves no room to generate within the model's context."""


class SequenceDecoder:
    def __init__(
        self,
        target: Target,
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
        self.drafter = drafter if request.speculation.enabled else None
        self._shared_policy = policy
        self._new_policy = new_policy
        self.policies: dict[str, AdaptiveSpeculation] = {}  # by draft source
        self.source = ""  # the source that drafts the next round
        self._source_round = -1  # the round it was chosen for
        # Sampling randomness: keyed by (seed, choice, position), or rejection sampling's
        # generator; verify() is told each round's first position.
        self.generator = make_randomness(self.params, target.device)
        self.stop_ids = target.eos_token_ids | frozenset(request.stop_token_ids)
        self.max_new = min(request.max_new_tokens, target.max_context - prompt_len)
        self.tokens: list[int] = list(request.prompt_ids)
        self.output: list[int] = []
        self.text = TextStream(target.tokenizer, request.stop)
        self.state: Any = target.new_state()
        self.draft_state: Any = self.drafter.begin(request.prompt_ids) if self.drafter else None
        # the target's hidden states by position, for a drafter that reads them
        self.features = (FeatureRows() if self.drafter is not None and self.drafter.reads_features
                         and target.capabilities.features else None)
        self.rounds = 0
        self.finish_reason: FinishReason | None = None
        self._counts: torch.Tensor | None = None
        self.prefix_cache = prefix_cache
        self.cached_tokens = 0
        self._store_prefix_pending = prefix_cache is not None
        self._prefilled: int | None = None  # prompt tokens in the cache during round 0
        self._prefill_s = 0.0
        self._round_start = 0.0
        self._prompt_logprobs = PromptLogprobs(request.prompt_ids, request.top_logprobs)
        spec = request.speculation  # a grammar the output must match (decoding/constrained.py)
        self.grammar = None if request.grammar is None else ConstrainedDecoding(
            request.grammar, self.stop_ids, spec.enabled and spec.drafter != "none")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilled(self) -> int:
        """Prompt tokens in the target's cache (round 0)."""
        return self._prefilled or 0

    @property
    def policy(self) -> AdaptiveSpeculation:
        """The draft-length policy of the source that drafts the next round."""
        policy = self.policies.get(self.source)
        if policy is None:
            policy = self._shared_policy or (
                self._new_policy(self.source) if self._new_policy else AdaptiveSpeculation())
            cap = self.request.speculation.max_draft_tokens
            if cap is not None:
                policy.max_tokens = min(policy.max_tokens, cap)
            self.policies[self.source] = policy
        return policy

    def choose_source(self) -> None:
        """Let the drafter say which of its sources drafts the next round (once per
        round); ``policy`` is then that source's."""
        if self.drafter is None or self.rounds == 0 or self._source_round == self.rounds:
            return
        self.source = self.drafter.source(self.draft_state, self.draft_context())
        self._source_round = self.rounds

    def next_prompt_chunk(self, limit: int = 0) -> PromptChunk:
        """The next at most ``limit`` prompt tokens to prefill (0: all the rest), after
        the longest cached prefix (none when the prompt's log-probabilities are asked
        for: a cached position's logits were never computed)."""
        if self.finished or self.rounds:
            raise RuntimeError("the prompt has been prefilled")
        if self._prefilled is None:
            self._round_start = time.perf_counter()
            cache = None if self.request.prompt_logprobs else self.prefix_cache
            self.cached_tokens = load_prefix(cache, self.target, self.state,
                                             self.request.prompt_ids)
            self._prefilled = self.cached_tokens
        rest = self.request.prompt_ids[self._prefilled :]
        chunk = rest[:limit] if limit else rest
        return PromptChunk(chunk, final=len(chunk) == len(rest))

    def propose(self, k: int, made: tuple[DraftProposal, float] | None = None) -> Draft:
        """This round's draft of at most ``k`` tokens, or ``made`` (a proposal drafted with
        other sequences' in one batch, and its share of that batch's seconds)."""
        if self.finished:
            raise RuntimeError("the sequence has already finished")
        start = time.perf_counter()
        if self._store_prefix_pending:  # after the first token went out, not before
            self._store_prefix_now()
        if made is None:
            drafting = time.perf_counter()
            proposal = self._propose(k)
            made = (proposal, time.perf_counter() - drafting)
        proposal, seconds = made
        remaining = self.max_new - len(self.output)
        constrained = None
        if self.grammar is not None:  # forced drafts lead, forbidden ones are cut
            constrained = self.grammar.draft(proposal, len(self.output), max(0, remaining - 1),
                                             sampled=self.generator is not None)
            proposal = constrained.proposal
        tokens = tuple(proposal.tokens[: max(0, remaining - 1)])
        alternative = (proposal.alternative  # a draft token too: within the round's cap
                       if tokens and len(tokens) < self.policy.max_tokens
                       and self.takes_alternatives else None)
        probs = proposal.probs[: len(tokens)] if proposal.probs is not None else None
        policy = self.policy if self.drafter is not None else None
        expected = policy.expected_tokens(len(tokens)) if policy is not None and tokens else []
        return Draft(tokens, probs, alternative, proposal, seconds, start, policy,
                     expected[-1] - 1.0 if expected else None, constrained)

    def pass_item(self, part: PromptChunk | Draft) -> BatchItem:
        """What the target runs for this sequence: a prompt chunk, or the pending token,
        the draft and (last) the alternative. A prompt chunk keeps the logits of its last
        token when it is the prompt's last, or of every token when the prompt's
        log-probabilities are asked for."""
        features = self.features is not None
        if isinstance(part, PromptChunk):
            keep = (len(part.tokens) if self.request.prompt_logprobs
                    else 1 if part.final else 0)
            return BatchItem(self.state, part.tokens, keep, features=features)
        tokens = [self.tokens[-1], *part.tokens]
        if part.alternative is not None:
            tokens.append(part.alternative)
        return BatchItem(self.state, tokens, len(tokens), alternative=part.alternative is not None,
                         features=features)

    def prompt_done(self, chunk: PromptChunk, logits: torch.Tensor, forward_s: float,
                    features: torch.Tensor | None = None,  # [n, H]
                    ) -> RoundEvent | None:
        """After a prompt chunk's pass (``logits``: the rows ``pass_item`` kept): nothing
        yet, or (the last chunk) the first token."""
        assert self._prefilled is not None
        if self.features is not None and features is not None:
            self.features.add(self._prefilled, features)
        if self.request.prompt_logprobs:
            self._prompt_logprobs.add(self._prefilled, len(chunk.tokens), logits)
        self._prefilled += len(chunk.tokens)
        self._prefill_s += forward_s
        if not chunk.final:
            return None
        last = logits[-1:]  # [1, vocab]: the first new token's
        token = verify((), None, self.process(last, ()), self.generator,
                       len(self.tokens)).next_token
        return self.commit([token], 0, 0, last, RoundTiming(0.0, self._prefill_s, 0.0),
                           self._round_start)

    def keep(self, verdict: Verdict, passed: int,
             features: torch.Tensor | None = None,  # [passed, H]
             ) -> None:
        """Roll the target's cache back to what verification kept of a pass of ``passed``
        tokens (pending, drafts, then any alternative), and keep the kept tokens'
        ``features``."""
        pending = len(self.tokens) - 1  # the pending token's position
        if verdict.alternative_taken:
            self.target.adopt_alternative(self.state, pending, passed)
        else:
            self.target.rollback(self.state, len(self.tokens) + verdict.accepted)
        if self.features is not None and features is not None:
            self.features.add(pending, features[[0, -1]] if verdict.alternative_taken
                              else features[: verdict.accepted + 1])

    def learn(self, draft: Draft, verdict: Verdict, timing: RoundTiming) -> None:
        """Tell the draft source's policy how the round went."""
        if draft.policy is None:
            return
        proposal = draft.proposal  # the policy is told of its own drafts, not the grammar's
        forced = draft.constrained.forced if draft.constrained is not None else 0
        draft.policy.update(
            len(draft.tokens) - forced, max(0, verdict.accepted - forced), timing.draft_s,
            timing.verify_s, proposal.confidence[forced : len(draft.tokens) + 1],
            alternative=(proposal.alternative_confidence if draft.alternative is not None
                         else None),
            alternative_taken=verdict.alternative_taken)

    def undo(self, part: PromptChunk | Draft) -> None:
        """Forget a pass that failed: the cache as it was."""
        if self.state is None:
            return
        committed = self._prefilled if isinstance(part, PromptChunk) else len(self.tokens)
        self.target.rollback(self.state, committed or 0)

    def failed(self, error: str) -> RoundEvent:
        """The final event of a sequence that failed (its caches freed)."""
        self.close()
        self.finish_reason = FinishReason.ERROR
        return self.final_event(FinishReason.ERROR, error)

    def final_event(self, reason: FinishReason, error: str | None = None) -> RoundEvent:
        """An event that ends the sequence without new tokens (timeout, error,
        cancellation); a timeout keeps the text held back so far."""
        return RoundEvent(
            token_ids=(), text=self.text.flush() if reason is FinishReason.TIMEOUT else "",
            draft_tokens=0, accepted_tokens=0, finish_reason=reason, timing=RoundTiming(),
            round_index=self.rounds, prompt_tokens=len(self.request.prompt_ids),
            completion_tokens=len(self.output), error=error)

    def draft_length(self, k: int | None = None) -> int:
        """How many tokens to draft next round: ``k`` (``None``: the policy's choice),
        never past ``max_tokens``. Asking the policy counts as its decision."""
        remaining = self.max_new - len(self.output)
        if self.drafter is None:
            return 0
        if k is None:
            self.choose_source()
            k = self.policy.next_k(remaining - 1)
        return max(0, min(k, remaining - 1))

    def draft_context(self) -> DraftContext:
        tokens = (self.tokens if self.grammar is None  # after the grammar's forced tokens
                  else self.grammar.context(self.tokens, len(self.output)))
        return DraftContext(tokens, self.params, self.generator, judge=self,
                            features=self.features)

    # How far a round drafts, as the drafting source's policy judges (``DraftJudge``).
    def worth_proposing(self, confidences: Sequence[float]) -> bool:
        return self.policy.worth_proposing(confidences)

    def worth_continuing(self, confidences: Sequence[float]) -> bool:
        return self.policy.worth_continuing(confidences)

    def worth_alternative(self, confidences: Sequence[float], confidence: float) -> bool:
        return self.takes_alternatives and self.policy.worth_alternative(confidences, confidence)

    @property
    def takes_alternatives(self) -> bool:
        """Whether a round may verify an alternative for its first draft token: greedy
        decoding without penalties (a penalised or sampled row after the alternative
        would need counts and a distribution of their own), on a target that runs
        token trees."""
        return (self.generator is None and not self.params.has_penalties
                and self.target.capabilities.branches and self.grammar is None)

    def close(self) -> None:
        """Free the KV caches (idempotent)."""
        if self.state is not None:
            self.target.release(self.state)
            self.state = None
        if self.drafter is not None and self.draft_state is not None:
            self.drafter.release(self.draft_state)
            self.draft_state = None

    def _store_prefix_now(self) -> None:
        self._store_prefix_pending = False
        assert self.prefix_cache is not None
        store_prefix(self.prefix_cache, self.target, self.state, self.request.prompt_ids,
                     self.cached_tokens)

    def _propose(self, k: int) -> DraftProposal:
        if self.drafter is None or k <= 0:
            return DraftProposal.empty()
        return self.drafter.propose(self.draft_state, self.draft_context(), k)

    def process(self, logits: torch.Tensor, draft: Sequence[int]) -> torch.Tensor:  # [n, V]
        """The grammar's mask, penalties, then (when sampling) temperature/top-k/top-p
        into probabilities."""
        if self.grammar is not None:  # the mask at every verified position
            logits = self.grammar.mask(logits, draft)
        if self.params.has_penalties:
            if self._counts is None:
                self._counts = output_counts(self.output, logits.shape[-1], logits.device)
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
        new = new[: self.max_new - len(self.output)]
        finish: FinishReason | None = None
        for i, token in enumerate(new):
            if token in self.stop_ids:
                new, finish = new[: i + 1], FinishReason.STOP
                break
        text_tokens = new[:-1] if finish is FinishReason.STOP else new
        update = self.text.push(text_tokens)
        delta = update.delta
        if update.stopped:
            new, finish = new[: update.tokens_used], FinishReason.STOP
        self.tokens.extend(new)
        self.output.extend(new)
        if self.grammar is not None:  # keep the committed, drop the rejected
            self.grammar.sync(self.output)
        if self._counts is not None:
            for token in new:
                self._counts[token] += 1
        if self.drafter is not None:
            self.drafter.rollback(self.draft_state, len(self.tokens))
        if finish is None and len(self.output) >= self.max_new:
            finish = FinishReason.LENGTH
        if finish is not None and not update.stopped:
            delta += self.text.flush()
        self.finish_reason = finish
        logprobs = (token_logprobs(new, logits, self.request.top_logprobs)
                    if self.request.logprobs else ())
        self.rounds += 1
        if finish is not None:
            if self._store_prefix_pending:  # finished in its first round
                self._store_prefix_now()
            if self.prefix_cache is not None and finish in _REMEMBERED:
                remember_continuation(self.prefix_cache, self.tokens,
                                      len(self.request.prompt_ids))
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
            completion_tokens=len(self.output),
            cached_tokens=self.cached_tokens if self.rounds == 1 else 0,
            prompt_logprobs=self._prompt_logprobs.take(),
            draft_source=(self.source or (self.drafter.name if self.drafter else "")
                          if drafted else ""),
        )
