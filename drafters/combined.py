"""Several drafters at once: deterministic ones (n-gram lookup, continuations) and at
most one model.

The cheap drafters all propose and the longest proposal wins. The model runs when
they found nothing, and also when their proposals have lately kept fewer tokens
than the model's: every proposal is scored afterwards against what the target
committed (an unused cheap proposal too, since scoring it costs nothing), and the
tokens each source gets kept per proposal are averaged per request, starting from
what earlier requests measured (a model not yet measured is tried once lookup keeps
less than a token). Grounded text, where lookup copies long runs, keeps lookup in
charge; chat, where lookup matches are mostly coincidence, goes to the model.

Which source drafts a round is decided before its length (``source()``): lookup
and the model are right in different runs and cost different amounts, so the
sequence keeps a draft-length policy for each. Lookup's proposal is made once per
round, as long as any policy may ask for, and cut to the length chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decoding.drafter import BaseDrafter, DraftContext, Drafter, DraftProposal
from decoding.policy import MAX_DRAFT_TOKENS

# The model must keep this many more tokens per proposal than lookup before it takes
# a round that lookup could have drafted for free (a draft token costs the model about
# a tenth of a target step; a round drafts a few).
MODEL_MARGIN = 0.25
MODEL_GUESS = 1.0  # tokens kept per proposal assumed for a model not yet measured
REQUEST_RATE = 0.25  # weight of the newest outcome in a request's estimate
PRIOR_RATE = 0.05  # ... and in the estimate new requests start from

CHEAP, MODEL = 0, 1
SOURCES = ("lookup", "model")  # names of the sources, as the decoder's policies know them


@dataclass
class _Proposed:
    start: int  # committed tokens when it was proposed
    tokens: tuple[int, ...]
    source: int  # CHEAP or MODEL


@dataclass(frozen=True)
class _Round:
    length: int  # committed tokens when it was decided
    lookup: DraftProposal  # the longest cheap proposal, MAX_DRAFT_TOKENS long at most
    source: int  # CHEAP or MODEL


@dataclass
class CombinedState:
    parts: list[object]  # each drafter's own state (opaque here)
    kept: list[float | None]  # per source: tokens the target kept per proposal
    pending: list[_Proposed] = field(default_factory=list)  # scored on the next call
    round: _Round | None = None  # this round's decision, once made


class CombinedDrafter(BaseDrafter[CombinedState]):
    def __init__(self, cheap: Sequence[Drafter], model: Drafter | None = None) -> None:
        if not cheap and model is None:
            raise ValueError("CombinedDrafter needs at least one drafter")
        self.cheap = list(cheap)
        self.model = model
        self.name = "+".join(d.name for d in [*self.cheap, *([model] if model else [])])
        self.reads_features = any(d.reads_features for d in self._all())
        self.prior: list[float | None] = [None, None]  # across requests, by source

    def begin(self, prompt_ids: Sequence[int]) -> CombinedState:
        return CombinedState([d.begin(prompt_ids) for d in self._all()], list(self.prior))

    def warmup(self) -> None:
        for drafter in self._all():
            drafter.warmup()

    def source(self, state: CombinedState, context: DraftContext) -> str:
        """Which source drafts the next round: "lookup" or "model"."""
        return SOURCES[self._round(state, context).source]

    def propose(self, state: CombinedState, context: DraftContext, k: int) -> DraftProposal:
        return self.propose_many([state], [context], [k])[0]

    def propose_many(self, states: Sequence[CombinedState], contexts: Sequence[DraftContext],
                     ks: Sequence[int]) -> list[DraftProposal]:
        """Lookup's proposal for the sequences it drafts, the model's for the others
        (those steps run together)."""
        chosen: list[DraftProposal] = []
        for_model: list[int] = []
        for i, (state, context, k) in enumerate(zip(states, contexts, ks, strict=True)):
            decided = self._round(state, context)
            scored = decided.lookup.tokens[: max(k, 1)]
            if scored:  # scored even when unused (at least one token): it costs nothing
                state.pending.append(_Proposed(decided.length, scored, CHEAP))
            if decided.source == MODEL and k > 0:
                for_model.append(i)
            chosen.append(DraftProposal(scored[:k]) if decided.source == CHEAP
                          else DraftProposal.empty())
        if self.model is not None and for_model:
            proposals = self.model.propose_many([states[i].parts[-1] for i in for_model],
                                     [contexts[i] for i in for_model], [ks[i] for i in for_model])
            for i, proposal in zip(for_model, proposals, strict=True):
                chosen[i] = proposal
                if proposal.tokens:
                    states[i].pending.append(
                        _Proposed(len(contexts[i].token_ids), proposal.tokens, MODEL))
        return chosen

    def _round(self, state: CombinedState, context: DraftContext) -> _Round:
        """This round's lookup proposal and source, decided once (committed tokens only
        grow, so their count tells rounds apart)."""
        length = len(context.token_ids)
        if state.round is not None and state.round.length == length:
            return state.round
        self._score(state, context.token_ids)
        best = DraftProposal.empty()
        for drafter, sub in zip(self.cheap, state.parts, strict=False):
            proposal = drafter.propose(sub, context, MAX_DRAFT_TOKENS)
            if len(proposal.tokens) > len(best.tokens):
                best = proposal
        use_model = self.model is not None and (not best.tokens or self._model_leads(state))
        state.round = _Round(length, best, MODEL if use_model else CHEAP)
        return state.round

    def rollback(self, state: CombinedState, length: int) -> None:
        for drafter, sub in zip(self._all(), state.parts, strict=True):
            drafter.rollback(sub, length)

    def release(self, state: CombinedState) -> None:
        for drafter, sub in zip(self._all(), state.parts, strict=True):
            drafter.release(sub)
        state.pending.clear()
        state.round = None

    def _model_leads(self, state: CombinedState) -> bool:
        cheap, model = state.kept
        if cheap is None:  # lookup's proposals are free: try them first
            return False
        return (MODEL_GUESS if model is None else model) > cheap + MODEL_MARGIN

    def _score(self, state: CombinedState, committed: Sequence[int]) -> None:
        """Score the proposals whose fate the target has since decided: how many of
        their tokens it kept (a mismatch, or the whole proposal, is committed)."""
        waiting = []
        for p in state.pending:
            after = committed[p.start : p.start + len(p.tokens)]
            kept = 0
            while kept < len(after) and after[kept] == p.tokens[kept]:
                kept += 1
            if kept == len(after) and kept < len(p.tokens):  # not decided yet
                waiting.append(p)
                continue
            state.kept[p.source] = _mix(state.kept[p.source], kept, REQUEST_RATE)
            self.prior[p.source] = _mix(self.prior[p.source], kept, PRIOR_RATE)
        state.pending = waiting

    def _all(self) -> list[Drafter]:
        return [*self.cheap, *([self.model] if self.model is not None else [])]


def _mix(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new
