"""One request's speculative decoding, one round per ``step()``.

Round 0 prefills the prompt and takes the first token from the target. Every
later round: the drafter proposes k tokens, the target scores the last
committed token plus the k drafts in one forward pass, ``verify()`` keeps the
acceptable prefix plus one target token, and both KV caches are rolled back to
the committed length. Greedy, a model drafter's second choice for the first
draft token may ride along at the end of the pass (a two-branch token tree);
when the target rejects the first draft token for it, it and the target's token
after it are kept.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from decoding.drafters.base import DraftContext, Drafter, DraftProposal, draft_source
from decoding.policy import AdaptiveSpeculation
from decoding.prefix_cache import PrefixCache
from decoding.sampling import apply_penalties, logits_to_probs, make_randomness, output_counts
from decoding.target import BatchItem, CausalLM
from decoding.text import TextStream
from decoding.types import (
    FinishReason,
    GenerationRequest,
    RoundEvent,
    RoundTiming,
    TokenLogprob,
)
from decoding.verify import verify

log = logging.getLogger(__name__)


_REMEMBERED = (FinishReason.STOP, FinishReason.LENGTH)


@dataclass
class RoundPlan:
    """One round's work for the target: ``item`` to run, and what to verify after."""

    item: BatchItem
    prefill: bool = False
    final: bool = True  # the prompt's last chunk (prefill only)
    draft: list[int] = field(default_factory=list)
    alternative: int | None = None  # verified beside draft[0], last in the pass
    proposal: DraftProposal | None = None
    started: float = 0.0
    draft_s: float = 0.0
    policy: AdaptiveSpeculation | None = None  # the draft source's policy, told the outcome


class ContextOverflowError(ValueError):
    """The prompt leaves no room to generate within the model's context."""


class SequenceDecoder:
    def __init__(
        self,
        target: CausalLM,
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
        self.rounds = 0
        self.finish_reason: FinishReason | None = None
        self._counts: torch.Tensor | None = None
        self.prefix_cache = prefix_cache
        self.cached_tokens = 0
        self._store_prefix_pending = prefix_cache is not None
        self._prefilled: int | None = None  # prompt tokens in the cache during round 0
        self._prefill_s = 0.0
        self._round_start = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

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
        self.source = draft_source(self.drafter, self.draft_state, self.draft_context())
        self._source_round = self.rounds

    def step(self) -> RoundEvent:
        """Run one round and describe what it committed (the whole prompt's prefill is
        one round here; an engine can feed a long prompt in chunks with ``plan``)."""
        while True:
            plan = self.plan()
            start = time.perf_counter()
            logits = self.target.forward_batch([plan.item])[0]
            event = self.complete(plan, logits, time.perf_counter() - start)
            if event is not None:
                return event

    def plan(self, k: int | None = None, prefill_chunk: int | None = None,
             drafted: tuple[DraftProposal, float] | None = None) -> RoundPlan:
        """What the target must run next for this sequence: the next piece of the
        prompt, or the pending token plus ``k`` drafts (``None``: the policy's k), or
        the ``drafted`` proposal (made with others' in one batch, and its share of that
        batch's seconds)."""
        if self.finished:
            raise RuntimeError("the sequence has already finished")
        start = time.perf_counter()
        if self.rounds == 0:
            if self._prefilled is None:
                self.cached_tokens = self._load_prefix()
                self._prefilled = self.cached_tokens
                self._round_start = start
            rest = self.request.prompt_ids[self._prefilled :]
            chunk = rest[:prefill_chunk] if prefill_chunk else rest
            final = len(chunk) == len(rest)
            return RoundPlan(BatchItem(self.state, chunk, 1 if final else 0), prefill=True,
                             final=final, started=start)
        if self._store_prefix_pending:  # after the first token went out, not before
            self._store_prefix()
            start = time.perf_counter()
        if drafted is None:
            proposal = self._propose(self.draft_length(k))
            draft_s = time.perf_counter() - start
        else:
            proposal, draft_s = drafted
        remaining = self.max_new - len(self.output)
        draft = list(proposal.tokens[: max(0, remaining - 1)])
        alternative = (proposal.alternative  # a draft token too: within the round's cap
                       if draft and len(draft) < self.policy.max_tokens
                       and self.takes_alternatives else None)
        tokens = [self.tokens[-1], *draft]  # the pending token, then the drafts
        if alternative is not None:  # then the second choice for draft[0]'s place
            tokens.append(alternative)
        return RoundPlan(BatchItem(self.state, tokens, len(tokens),
                                   alternative=alternative is not None),
                         draft=draft, alternative=alternative, proposal=proposal,
                         started=start, draft_s=draft_s, policy=self.policy)

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
        return DraftContext(self.tokens, self.params, self.generator, judge=self)

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
                and self.target.branches)

    def complete(self, plan: RoundPlan, logits: torch.Tensor, forward_s: float
                 ) -> RoundEvent | None:
        """Verify and commit a planned round from the target's logits for it (None
        after a prompt chunk that is not the last: nothing to commit yet)."""
        if plan.prefill:
            self._prefilled = (self._prefilled or 0) + len(plan.item.token_ids)
            self._prefill_s += forward_s
            if not plan.final:
                return None
            scores = self._process(logits, [])
            token = verify((), None, scores, self.generator, len(self.tokens)).next_token
            timing = RoundTiming(0.0, self._prefill_s, 0.0)
            return self._commit([token], 0, 0, logits, timing, self._round_start)
        draft = plan.draft
        scores = self._process(logits[: len(draft) + 1], draft)
        probs = plan.proposal.probs if plan.proposal is not None else None
        draft_probs = probs[: len(draft)] if probs is not None else None
        verify_start = time.perf_counter()
        verdict = verify(draft, draft_probs, scores, self.generator, len(self.tokens))
        taken = (plan.alternative is not None and verdict.accepted == 0
                 and verdict.next_token == plan.alternative)
        if taken:  # greedy, unpenalised: the target's choice after the alternative is its argmax
            committed = [verdict.next_token, int(logits[-1].argmax().item())]
            behind = torch.stack([logits[0], logits[-1]])  # the logits each token came from
            # The cache holds pending, drafts, alternative; keep pending + alternative.
            self.target.adopt_alternative(self.state, len(self.tokens) - 1,
                                          len(plan.item.token_ids))
        else:
            committed, behind = verdict.committed(draft), logits
            # The cache holds pending + drafts (+ alternative); keep pending + the accepted.
            self.target.rollback(self.state, len(self.tokens) + verdict.accepted)
        verify_s = forward_s + time.perf_counter() - verify_start
        timing = RoundTiming(plan.draft_s, verify_s, 0.0)
        if plan.policy is not None:
            proposal = plan.proposal
            confidences = proposal.confidence if proposal is not None else ()
            plan.policy.update(
                len(draft), verdict.accepted, timing.draft_s, timing.verify_s,
                confidences[: len(draft) + 1],
                alternative=(proposal.alternative_confidence
                             if plan.alternative is not None and proposal is not None else None),
                alternative_taken=taken)
        drafted = len(draft) + (plan.alternative is not None)
        return self._commit(committed, drafted, 1 if taken else verdict.accepted, behind,
                            timing, plan.started)

    def undo(self, plan: RoundPlan) -> None:
        """Forget a planned round whose forward pass failed: the cache as it was."""
        if self.state is None:
            return
        committed = self._prefilled if plan.prefill else len(self.tokens)
        self.target.rollback(self.state, committed or 0)

    def close(self) -> None:
        """Free the KV caches (idempotent)."""
        if self.state is not None:
            self.target.release(self.state)
            self.state = None
        if self.drafter is not None and self.draft_state is not None:
            self.drafter.release(self.draft_state)
            self.draft_state = None

    def _load_prefix(self) -> int:
        """Reuse the KV of the longest cached prompt prefix; a failure is a miss."""
        if self.prefix_cache is None:
            return 0
        try:
            hit = self.prefix_cache.lookup(self.request.prompt_ids, self.target.num_layers)
            if hit is None:
                return 0
            self.target.load_kv(self.state, hit.kv)
            return hit.tokens
        except Exception:
            log.exception("prefix cache lookup failed; prefilling the whole prompt")
            self.prefix_cache.stats.add(errors=1)
            self.target.rollback(self.state, 0)
            return 0

    def _store_prefix(self) -> None:
        self._store_prefix_pending = False
        assert self.prefix_cache is not None
        try:
            skip = self.cached_tokens // self.prefix_cache.block_tokens
            self.prefix_cache.store_prefix(self.request.prompt_ids, self.target.kv(self.state),
                                           skip_blocks=skip)
        except Exception:
            log.exception("storing the prompt's KV failed")
            self.prefix_cache.stats.add(errors=1)

    def _remember_continuation(self) -> None:
        assert self.prefix_cache is not None
        try:
            self.prefix_cache.remember(self.tokens, start=len(self.request.prompt_ids))
        except Exception:
            log.exception("remembering the continuation failed")
            self.prefix_cache.stats.add(errors=1)

    def _propose(self, k: int) -> DraftProposal:
        if self.drafter is None or k <= 0:
            return DraftProposal.empty()
        return self.drafter.propose(self.draft_state, self.draft_context(), k)

    def _process(self, logits: torch.Tensor, draft: list[int]) -> torch.Tensor:  # [n, V]
        """Penalties, then (when sampling) temperature/top-k/top-p into probabilities."""
        if self.params.has_penalties:
            if self._counts is None:
                self._counts = output_counts(self.output, logits.shape[-1], logits.device)
            logits = apply_penalties(logits, self._counts, draft, self.params)
        if self.generator is None:
            return logits
        return logits_to_probs(logits, self.params)

    def _commit(
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
        logprobs = self._logprobs(new, logits) if self.request.logprobs else ()
        self.rounds += 1
        if finish is not None:
            if self._store_prefix_pending:  # finished in its first round
                self._store_prefix()
            if self.prefix_cache is not None and finish in _REMEMBERED:
                self._remember_continuation()
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
            draft_source=(self.source or getattr(self.drafter, "name", "")) if drafted else "",
        )

    def _logprobs(self, new: list[int], logits: torch.Tensor) -> tuple[TokenLogprob, ...]:
        if not new:
            return ()
        logp = torch.log_softmax(logits[: len(new)].float(), dim=-1)  # [n, V]
        chosen = logp[torch.arange(len(new)), torch.tensor(new)].tolist()
        top_n = self.request.top_logprobs
        tops: list[list[tuple[int, float]]] = [[] for _ in new]
        if top_n > 0:
            values, indices = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)
            tops = [list(zip(i, v, strict=True))
                    for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
        return tuple(
            TokenLogprob(token_id=t, logprob=lp, top=tuple(top))
            for t, lp, top in zip(new, chosen, tops, strict=True)
        )


def decode(
    target: CausalLM,
    drafter: Drafter | None,
    request: GenerationRequest,
    policy: AdaptiveSpeculation | None = None,
    prefix_cache: PrefixCache | None = None,
) -> Iterator[RoundEvent]:
    """Run one request to the end in the calling thread, yielding each round."""
    decoder = SequenceDecoder(target, drafter, request, policy, prefix_cache)
    try:
        while not decoder.finished:
            yield decoder.step()
    finally:
        decoder.close()
