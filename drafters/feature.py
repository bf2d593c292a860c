"""A drafter that reads the target's features (``runtime.drafts.feature_draft``, EAGLE-style).

Each round it first feeds the committed tokens it has not fed yet, each beside the
target's feature before it (its final hidden state, or for a fused draft its captured
layers' outputs fused: the verify pass computed those and the sequence keeps them,
``DraftContext.features``), and then drafts on its own outputs: a drafted
token beside the draft's own last state. What it fed on its own states is rolled back
at the next round and fed again with the target's, so the draft's KV holds the target's
features for every committed token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol

import torch

from decoding.drafter import DraftContext
from drafters.model import CHAIN_STEPS, CacheT, DraftedFor, DraftModel, StepDrafter
from runtime.runner.passes import BatchItem, DraftSteps, PreparedPass


class FeatureRunner(DraftModel[CacheT], Protocol[CacheT]):
    """The draft's layer: a runner that starts from given rows (``BatchItem.inputs``) and
    gives its own final states (``BatchItem.features``)."""

    dtype: torch.dtype

    def prepare_pass(self, items: Sequence[BatchItem[CacheT]]) -> PreparedPass[CacheT]: ...

    def run_pass(self, prepared: PreparedPass[CacheT]) -> list[torch.Tensor]: ...


class FeatureModel(Protocol[CacheT]):
    """A draft over the target's features (``runtime.drafts.feature_draft.FeatureDraft``): its
    layer, the rows it starts each position from, and its native chain."""

    @property
    def runner(self) -> FeatureRunner[CacheT]: ...

    def target_feature(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, H (+ L*H)] of the target's -> [n, H]: its rows as the draft reads them."""
        ...

    def inputs(self, token_ids: Sequence[int], features: torch.Tensor) -> torch.Tensor:
        """[n, H]: each token's embedding beside the feature before it, fused."""
        ...

    def chains(self, vocab: int) -> bool:
        """Whether greedy steps run in one native call (``draft_chain``)."""
        ...

    def draft_chain(self, caches: Sequence[CacheT], feeds: Sequence[Sequence[int]],
                    steps: Sequence[int], vocab: int,
                    carried: Sequence[torch.Tensor]) -> list[DraftSteps]:
        """Each sequence fed its tokens, each beside its carried row and then its own
        states, and ``steps`` tokens drafted (``ChainDrafting.draft_chain``)."""
        ...


@dataclass
class FeatureDraftState(Generic[CacheT]):
    cache: CacheT  # the draft layer's KV: entry e holds the token at first + e
    first: int = 1  # the position of the first entry's token
    fed: list[int] = field(default_factory=list)  # the entries' tokens
    real: int = 0  # leading entries fed beside the target's own states
    last: torch.Tensor | None = None  # [H]: the draft's state after its last entry
    pending: torch.Tensor | None = None  # [n, H]: the target's states for the next feed
    judged: int = CHAIN_STEPS  # tokens the judge let through the last chained round


class FeatureDrafter(StepDrafter[FeatureDraftState[CacheT]]):
    reads_features = True

    def __init__(self, draft: FeatureModel[CacheT], target: DraftedFor | None = None,
                 name: str = "feature-draft") -> None:
        super().__init__(draft.runner, target, name=name)
        self.draft = draft

    def can_chain(self) -> bool:
        """Whether greedy rounds draft in one native call (the draft's ``chains``)."""
        return self.native_chain and self.draft.chains(self.target_vocab)

    def _chain_steps(self, states: Sequence[FeatureDraftState[CacheT]],
                     feeds: Sequence[list[int]], steps: Sequence[int]) -> list[DraftSteps]:
        """One native call: a round's catch-up beside the target's states, a later
        call's first token beside the state the call before left; every drafted token
        but the last fed back beside the draft's own state."""
        carried = []
        for state, feed in zip(states, feeds, strict=True):
            before = state.pending if state.pending is not None else state.last
            assert before is not None
            carried.append(before.reshape(len(feed), -1).to(self.draft.runner.dtype))
        drafted = self.draft.draft_chain([s.cache for s in states], feeds, steps,
                                         self.target_vocab, carried)
        for state, feed, n, got in zip(states, feeds, steps, drafted, strict=True):
            state.fed.extend(feed)
            if state.pending is not None:
                state.real, state.pending = len(state.fed), None
            state.fed.extend(got.tokens[: n - 1])
            assert got.state is not None
            state.last = got.state
        return drafted

    def begin(self, prompt_ids: Sequence[int]) -> FeatureDraftState[CacheT]:
        return FeatureDraftState(cache=self.draft.runner.new_state())

    def _catch_up(self, state: FeatureDraftState[CacheT],
                  context: DraftContext) -> list[int]:
        """Keep the entries fed beside the target's states; the committed tokens to feed
        beside theirs (none where the sequence holds no states for them)."""
        tokens, rows = context.token_ids, context.features
        last = len(tokens) - 1  # the newest committed token's position
        if rows is None or rows.end < last:  # its state before it is not there
            return []
        keep = state.real
        if keep and tokens[state.first + keep - 1] != state.fed[keep - 1]:
            keep = 0  # not the sequence this state was fed (a rewritten history)
        keep = max(0, min(keep, last - state.first))  # at least one token to feed
        start = state.first + keep if keep > 0 else max(1, rows.start + 1)
        if start - 1 < rows.start:  # the states before are gone: start again from theirs
            keep, start = 0, rows.start + 1
        if keep == 0:
            state.first = start
        self.draft.runner.rollback(state.cache, keep)
        del state.fed[keep:]
        state.real = keep
        # [last - start + 1, H]: fused from the target's layers where the draft reads them
        state.pending = self.draft.target_feature(rows.get(start - 1, last))
        return list(tokens[start : last + 1])

    def _step(self, states: list[FeatureDraftState[CacheT]],
              feeds: list[list[int]]) -> list[torch.Tensor]:
        items = []
        for state, feed in zip(states, feeds, strict=True):
            before = state.pending if state.pending is not None else state.last
            assert before is not None
            inputs = self.draft.inputs(feed, before.reshape(len(feed), -1))
            items.append(BatchItem(state.cache, feed, 1, features=True, inputs=inputs))
        runner = self.draft.runner
        prepared = runner.prepare_pass(items)
        logits = runner.run_pass(prepared)
        for state, feed, own in zip(states, feeds, prepared.features, strict=True):
            state.fed.extend(feed)
            if state.pending is not None:
                state.real, state.pending = len(state.fed), None
            assert own is not None
            state.last = own[-1]
        return [out[0] for out in logits]

    def rollback(self, state: FeatureDraftState[CacheT], length: int) -> None:
        keep = max(0, length - state.first)
        if keep < len(state.fed):
            self.draft.runner.rollback(state.cache, keep)
            del state.fed[keep:]
            state.real = min(state.real, keep)

    def release(self, state: FeatureDraftState[CacheT]) -> None:
        self.draft.runner.release(state.cache)
        state.fed.clear()
