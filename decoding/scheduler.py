"""The scheduler: which waiting requests join the batch, and how far each running stream
drafts.

A plain object, with no thread and no model: waiting requests, the KV blocks free and the
KV budget go in; which requests join (``admit``), which have waited
past their deadline (``expired``) and each drafting stream's draft length (``plan``) come
out. It also keeps what finished requests taught about each drafter and source (their
``SpeculationPrior``) and the fit of a pass's time (``StepCost``), so a new request's policy
starts from them and the batch plan is priced by them. The engine (``decoding.engine``)
runs what it plans on its model thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from decoding.kv_budget import KvBudget
from decoding.policy import AdaptiveSpeculation, SpeculationPrior, StepCost, plan_batch
from decoding.policy.cost import VerifyCurve
from decoding.streams import RequestStream


@dataclass(frozen=True)
class Admission:
    """A waiting request that joins the batch."""

    stream: RequestStream
    blocks: int  # the KV blocks it needs free to start (its prompt's and a margin)
    deadline: float | None  # when it ends with ``timeout``, on the scheduler's clock


@dataclass(frozen=True)
class RunningStream:
    """What the batch plan reads of a running stream about to draft."""

    drafter: str | None  # its drafter's name; None: it does not draft
    source: str  # the drafter's source that drafts this round
    policy: AdaptiveSpeculation | None  # that source's draft-length policy (None: no drafter)
    limit: int  # the most draft tokens it may take: its tokens left, less the round's own


class Scheduler:
    def __init__(
        self,
        kv_budget: KvBudget,
        max_active: int,
        batch_planning: bool = True,
        batched: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``batch_planning``: draft lengths chosen for the whole batch by expected
        goodput; else every stream drafts as its own policy says, whatever the batch size.
        ``batched``: the target runs many sequences in one pass (else there is no batch
        to plan)."""
        self.kv_budget = kv_budget  # a request waits while its prompt's KV blocks are not free
        self.max_active = max_active
        self.batch_planning = batch_planning
        self.batched = batched
        self.clock = clock  # what request deadlines are measured by
        self.step_cost = StepCost()  # a decoding pass's time by its tokens
        self.verify_curve: VerifyCurve | None = None  # the target's, where measured
        # a draft model's step in target steps, by drafter name, where measured
        self.draft_costs: dict[str, float] = {}
        # per drafter and draft source, from finished requests
        self._priors: dict[tuple[str, str], SpeculationPrior] = {}

    # -- admission -----------------------------------------------------------------

    def expired(self, waiting: Iterable[RequestStream]) -> list[RequestStream]:
        """The waiting requests whose deadline has passed (they end with ``timeout``)."""
        now = self.clock()
        return [s for s in waiting if s.request.timeout_s is not None
                and now > s.submitted_at + s.request.timeout_s]

    def admit(self, waiting: Iterable[RequestStream], running: int, free: int | None
              ) -> list[Admission]:
        """The requests at the head of ``waiting`` that join now, in order: while fewer
        than ``max_active`` run (``running`` do) and the blocks to start one more (its
        prompt's and a margin: not its longest answer) are among the ``free`` ones (None:
        no bound) beside those joining before it. The first that does not fit waits, and
        so do all behind it; with none running it joins all the same (a prompt beyond the
        whole pool was refused before it queued). A cancelled request joins only to be
        dropped: it takes no room."""
        joining: list[Admission] = []
        for stream in waiting:
            if running >= self.max_active:
                break
            blocks = self.kv_budget.to_start(len(stream.request.prompt_ids))
            if (not stream.cancelled and free is not None and blocks > free
                    and running > 0):
                break  # it waits (first in line) until running requests free their KV
            timeout = stream.request.timeout_s
            deadline = stream.submitted_at + timeout if timeout else None
            joining.append(Admission(stream, blocks, deadline))
            if not stream.cancelled:
                running += 1
                if free is not None:
                    free -= blocks
        return joining

    # -- the batch plan ------------------------------------------------------------

    def plan(self, streams: Sequence[RunningStream]) -> list[int | None]:
        """Per stream about to draft: its draft length, chosen for the batch as a whole
        (``plan_batch``: speculation shrinks as the batch grows and stops where plain
        batched decoding is faster), or None where its own policy chooses (no batch
        planning, a target of one sequence a pass, or nothing that drafts)."""
        if (not self.batch_planning or not self.batched
                or all(s.policy is None for s in streams)):  # nothing to plan
            return [None] * len(streams)
        policies = [s.policy for s in streams]
        limits = [s.limit for s in streams]
        draft_s = [s.policy.cost.draft_s_per_token if s.policy is not None else 0.0
                   for s in streams]
        calibration = [self.prior(s.drafter or "", s.source).calibration
                       if s.policy is not None else 1.0 for s in streams]
        lengths: list[int | None] = [
            *plan_batch(policies, limits, self.step_cost, draft_s, calibration)]
        return lengths

    # -- what requests taught ------------------------------------------------------

    def prior(self, drafter: str, source: str) -> SpeculationPrior:
        """What finished requests learned of a drafter's source."""
        prior = self._priors.get((drafter, source))
        if prior is None:
            cost = self.draft_costs.get(drafter, 0.0) if source in ("", "model") else 0.0
            prior = self._priors[drafter, source] = SpeculationPrior(curve=self.verify_curve,
                                                                     draft_cost=cost)
        return prior

    def new_policy(self, drafter: str | None, source: str) -> AdaptiveSpeculation:
        """A new request's policy for a source of its drafter, from earlier requests."""
        return self.prior(drafter or "", source).new_policy()

    def drafted(self, drafter: str | None, source: str, expected: float, accepted: int
                ) -> None:
        """A round that drafted: the accepted drafts its policy promised and those
        verification accepted, for the drafter's calibration (batch planning only)."""
        if self.batch_planning:
            self.prior(drafter or "", source).record(expected, accepted)

    def finished(self, drafter: str | None,
                 policies: Mapping[str, AdaptiveSpeculation]) -> None:
        """A request ended: fold its policies, by source, into its drafter's priors."""
        if drafter is not None:
            for source, policy in policies.items():
                self.prior(drafter, source).observe(policy)
