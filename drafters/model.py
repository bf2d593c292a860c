"""A small causal LM as the drafter (any model that shares the target's tokenizer).

The drafter runs over anything with the ``DraftModel`` shape: a PyTorch
``CausalLM`` here, or an exported step on ONNX Runtime or TensorRT (``trt/``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, cast

import torch

from decoding.drafter import BaseDrafter, DraftContext, DraftJudge, DraftProposal
from decoding.sampling import SamplingKey, logits_to_probs
from runtime.runner.passes import BatchItem, ChainDrafting, DraftSteps, TargetCapabilities

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The most greedy draft steps one native call makes: the chain drafts every step it is
# given before the judge sees any, so a longer call wastes the steps after the judge's
# stop; a shorter one pays a call more. A round's first call makes one step more than the
# judge let through the sequence's round before (docs/performance.md)
CHAIN_STEPS = 4

CacheT = TypeVar("CacheT")  # a draft model's per-sequence KV cache state


class TokenizerMismatchError(ValueError):
    """The draft and the target do not share a vocabulary."""


def check_same_vocabulary(target_tokenizer: PreTrainedTokenizerBase,
                          draft_tokenizer: PreTrainedTokenizerBase, draft_name: str) -> None:
    """Refuse a draft whose tokenizer differs from the target's."""
    target_vocab = target_tokenizer.get_vocab()
    draft_vocab = draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = sum(1 for t, i in draft_vocab.items() if target_vocab.get(t) != i)
    raise TokenizerMismatchError(
        f"draft {draft_name!r} does not share the target's tokenizer: vocabularies of "
        f"{len(draft_vocab)} and {len(target_vocab)} tokens differ on {differing} entries. "
        "A draft must use exactly the target's tokenizer."
    )


class DraftedFor(Protocol):
    """What a drafter reads of the target it drafts for: its tokenizer (a draft must use
    exactly it) and the vocabulary its logits span."""

    tokenizer: PreTrainedTokenizerBase
    vocab_size: int


class DraftModel(Protocol[CacheT]):
    """Decoding steps of a causal LM over KV caches it can roll back: a PyTorch runner
    (``CausalLM``) or an exported step (``trt/``)."""

    name: str
    vocab_size: int
    tokenizer: PreTrainedTokenizerBase

    @property
    def capabilities(self) -> TargetCapabilities:
        """``draft_chain``: a ``ChainDrafting`` runner too."""
        ...

    def new_state(self) -> CacheT: ...

    def forward_batch(self, items: Sequence[BatchItem]) -> list[torch.Tensor]:
        """Each item's tokens appended to its cache; each item's kept logits."""
        ...

    def rollback(self, state: CacheT, length: int) -> None: ...

    def release(self, state: CacheT) -> None: ...

    def warmup(self) -> None: ...


@dataclass
class ModelDraftState(Generic[CacheT]):
    cache: CacheT  # the draft model's KV cache state
    fed: list[int] = field(default_factory=list)  # tokens whose KV is in the cache
    judged: int = CHAIN_STEPS  # tokens the judge let through the last chained round


class StepState(Protocol):
    """What the shared drafting loop keeps in a drafter's per-sequence state."""

    judged: int  # tokens the judge let through the last chained round


StateS = TypeVar("StateS", bound=StepState)


class StepDrafter(BaseDrafter[StateS]):
    """A model's steps as drafts: one batched pass a step, or greedy steps in native
    chains where ``can_chain``. The per-sequence state, how a sequence is fed and how a
    step runs are the subclass's: ``ModelDrafter`` (a draft model over its own KV) and
    ``drafters.feature.FeatureDrafter`` (a head over the target's features)."""

    native_chain = True  # greedy rounds in one native call where the model offers it

    def __init__(self, model: DraftModel, target: DraftedFor | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, name: str = "draft") -> None:
        tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        if target is not None:
            check_same_vocabulary(target.tokenizer, tokenizer, model.name)
        self.model = model
        self.name = name
        self.target_vocab = target.vocab_size if target is not None else model.vocab_size

    def warmup(self) -> None:
        """Let the model prepare its kernels (a batched PyTorch model builds one per
        pass size) before the first request needs them."""
        self.model.warmup()

    def propose(self, state: StateS, context: DraftContext, k: int) -> DraftProposal:
        return self.propose_many([state], [context], [k])[0]

    @torch.inference_mode()
    def propose_many(self, states: Sequence[StateS], contexts: Sequence[DraftContext],
                     ks: Sequence[int]) -> list[DraftProposal]:
        """Draft for several sequences: greedy ones in one native call where the model
        has one (``can_chain``), the others step by step, draft step ``i`` of every
        sequence that wants an ``i``-th token as one batch (one forward pass on a
        batched model)."""
        feeds = [self._catch_up(state, context) if k > 0 else []
                 for state, context, k in zip(states, contexts, ks, strict=True)]
        chained = ([i for i, (feed, context) in enumerate(zip(feeds, contexts, strict=True))
                    if feed and context.generator is None] if self.can_chain() else [])
        out = self._stepped(states, contexts, [[] if i in chained else feed
                                               for i, feed in enumerate(feeds)], ks)
        if chained:
            proposals = self._chained([states[i] for i in chained],
                                      [contexts[i] for i in chained],
                                      [feeds[i] for i in chained], [ks[i] for i in chained])
            for i, proposal in zip(chained, proposals, strict=True):
                out[i] = proposal
        return out

    def _chained(self, states: Sequence[StateS], contexts: Sequence[DraftContext],
                 feeds: list[list[int]], ks: Sequence[int]) -> list[DraftProposal]:
        """Greedy drafts in native calls of up to ``CHAIN_STEPS`` steps for every sequence
        at once; the judge cuts each call's tokens where the step loop would have
        stopped (it reads only the confidences so far), and a sequence it lets go on past
        a call's last token drafts on in the next call."""
        proposed: list[list[int]] = [[] for _ in states]
        sure: list[list[float]] = [[] for _ in states]
        second: list[tuple[int, float] | None] = [None for _ in states]
        active = list(range(len(states)))
        first = True
        while active:
            # a round's first call: one step past what the judge let through last round
            steps = [min(ks[i] - len(proposed[i]), CHAIN_STEPS,
                         states[i].judged + 1 if first else CHAIN_STEPS) for i in active]
            first = False
            drafted = self._chain_steps([states[i] for i in active],
                                        [feeds[i] for i in active], steps)
            still = []
            for i, got in zip(active, drafted, strict=True):
                if second[i] is None:
                    second[i] = got.runner_up
                if self._judged(got, contexts[i].judge, ks[i], proposed[i], sure[i]):
                    feeds[i] = [got.tokens[-1]]
                    still.append(i)
            active = still
        for state, tokens in zip(states, proposed, strict=True):
            state.judged = len(tokens)
        return [self._proposal(p, [], c, s, context.judge)
                for p, c, s, context in zip(proposed, sure, second, contexts, strict=True)]

    @staticmethod
    def _judged(drafted: DraftSteps, judge: DraftJudge | None, k: int, proposed: list[int],
                sure: list[float]) -> bool:
        """Take ``drafted``'s tokens into ``proposed`` (their confidences into ``sure``) as
        far as the judge lets them; whether the sequence drafts on after the last."""
        for token, confidence in zip(drafted.tokens, drafted.confidences, strict=True):
            sure.append(confidence)
            if judge is not None and not judge.worth_proposing(sure):
                return False  # withheld
            proposed.append(token)
            if len(proposed) == k or (judge is not None and not judge.worth_continuing(sure)):
                return False
        return True

    def _stepped(self, states: Sequence[StateS], contexts: Sequence[DraftContext],
                 feeds: list[list[int]], ks: Sequence[int]) -> list[DraftProposal]:
        """Drafts one step a pass, for the sequences with something to feed."""
        proposed: list[list[int]] = [[] for _ in states]
        rows: list[list[torch.Tensor]] = [[] for _ in states]
        sure: list[list[float]] = [[] for _ in states]
        second: list[tuple[int, float] | None] = [None for _ in states]
        active = [i for i, feed in enumerate(feeds) if feed]
        while active:
            logits = self._step([states[i] for i in active], [feeds[i] for i in active])
            still = []
            for i, out in zip(active, logits, strict=True):
                first = not sure[i]  # the round's first token: its runner-up too
                position = len(contexts[i].token_ids) + len(sure[i])  # the draft token's
                token, probs, confidence, runner_up = self._pick(out, contexts[i], first,
                                                                 position)
                if first:
                    second[i] = runner_up
                sure[i].append(confidence)
                judge = contexts[i].judge
                if judge is not None and not judge.worth_proposing(sure[i]):
                    continue  # withheld: not worth verifying, and neither is what follows
                proposed[i].append(token)
                if probs is not None:
                    rows[i].append(probs)
                if len(proposed[i]) < ks[i] and (
                        judge is None or judge.worth_continuing(sure[i])):
                    feeds[i] = [token]
                    still.append(i)
            active = still
        return [self._proposal(p, r, c, s, context.judge)
                for p, r, c, s, context in zip(proposed, rows, sure, second, contexts,
                                               strict=True)]

    @staticmethod
    def _proposal(tokens: list[int], rows: list[torch.Tensor], confidences: list[float],
                  runner_up: tuple[int, float] | None, judge: DraftJudge | None
                  ) -> DraftProposal:
        """The round's draft, with the second choice for its first token where the judge
        finds that worth verifying too."""
        alternative = None
        if runner_up is not None and tokens and judge is not None:
            proposed = confidences[: len(tokens)]
            if judge.worth_alternative(proposed, runner_up[1]):
                alternative = runner_up
        return DraftProposal(tokens=tuple(tokens), probs=torch.stack(rows) if rows else None,
                             confidence=tuple(confidences),
                             alternative=alternative[0] if alternative else None,
                             alternative_confidence=alternative[1] if alternative else 0.0)

    def _pick(
        self, logits: torch.Tensor, context: DraftContext,  # logits: [vocab]
        runner_up: bool = False, position: int = 0,
    ) -> tuple[int, torch.Tensor | None, float, tuple[int, float] | None]:
        """The draft token, the distribution it was drawn from (None: greedy), the
        draft's confidence (its largest probability), and greedy with ``runner_up``, its
        second choice with that token's probability. Greedy, the confidence is the
        token's own; sampling, it must not be (a judge that withheld a sampled token for
        being unlikely would skew what verification accepts away from the target's
        distribution), so it depends on the distribution alone, never on the draw.
        Keyed sampling draws with the target's noise at ``position`` (the token's
        absolute position), so the draft agrees with the target's draw as often as the
        two distributions allow."""
        logits = fit_vocab(logits, self.target_vocab)
        if context.generator is None:
            scores = logits.float()
            first = int(scores.argmax().item())  # the first of tied maxima, as the target's
            if not runner_up:
                top = torch.exp(scores[first] - torch.logsumexp(scores, -1))
                return first, None, float(top.item()), None
            others = scores.clone()
            others[first] = float("-inf")
            second = int(others.argmax().item())
            shares = torch.exp(scores[[first, second]] - torch.logsumexp(scores, -1)).tolist()
            return first, None, float(shares[0]), (second, float(shares[1]))
        randomness = context.generator
        if isinstance(randomness, SamplingKey):
            probs = logits_to_probs(logits.unsqueeze(0), context.sampling)[0]  # [vocab]
            return randomness.draw(probs, position), probs, float(probs.max().item()), None
        logits = logits.to(randomness.device)  # the draft may run elsewhere
        probs = logits_to_probs(logits.unsqueeze(0), context.sampling)[0]  # [vocab]
        token = int(torch.multinomial(probs, 1, generator=randomness).item())
        return token, probs, float(probs.max().item()), None

    # -- what a subclass supplies ----------------------------------------------------

    def can_chain(self) -> bool:
        """Whether greedy rounds draft in native calls (``_chain_steps``)."""
        raise NotImplementedError

    def _chain_steps(self, states: Sequence[StateS], feeds: Sequence[list[int]],
                     steps: Sequence[int]) -> list[DraftSteps]:
        """One native call: each state fed its feed and ``steps`` drafted tokens, every
        one but the last fed back."""
        raise NotImplementedError

    def _catch_up(self, state: StateS, context: DraftContext) -> list[int]:
        """The committed tokens a sequence has yet to feed (its state rolled back to
        what still holds)."""
        raise NotImplementedError

    def _step(self, states: list[StateS], feeds: list[list[int]]) -> list[torch.Tensor]:
        """Each state's logits after its feed, ``[vocab]`` each."""
        raise NotImplementedError


class ModelDrafter(StepDrafter[ModelDraftState[CacheT]]):
    """A draft model's steps over its own KV cache."""

    model: DraftModel[CacheT]

    def can_chain(self) -> bool:
        """Whether greedy rounds draft in one native call (a model whose capabilities
        declare ``draft_chain``): a plain draft model's steps only (a subclass that feeds
        its own input rows, as a feature head does, drafts by its own steps)."""
        own_steps = (type(self)._step is ModelDrafter._step
                     and type(self)._catch_up is ModelDrafter._catch_up)
        chainer = self._chainer()
        # (without batch invariance a long catch-up takes the bulk products: not the chain's)
        return (self.native_chain and own_steps and chainer is not None
                and chainer.batch_invariant and chainer.chain(self.target_vocab) is not None)

    def _chainer(self) -> ChainDrafting[CacheT] | None:
        """The model as the chain-drafting runner its capabilities declare it is."""
        return (cast(ChainDrafting[CacheT], self.model) if self.model.capabilities.draft_chain
                else None)

    def begin(self, prompt_ids: Sequence[int]) -> ModelDraftState[CacheT]:
        return ModelDraftState(cache=self.model.new_state())

    def _chain_steps(self, states: Sequence[ModelDraftState[CacheT]], feeds: Sequence[list[int]],
                     steps: Sequence[int]) -> list[DraftSteps]:
        """One native call: each state fed its feed and ``steps`` drafted tokens, every
        one but the last fed back."""
        chainer = self._chainer()
        assert chainer is not None
        drafted = chainer.draft_chain([s.cache for s in states], feeds, steps, self.target_vocab)
        for state, feed, n, got in zip(states, feeds, steps, drafted, strict=True):
            state.fed.extend(feed)
            state.fed.extend(got.tokens[: n - 1])  # fed back within the call
        return drafted

    def _catch_up(self, state: ModelDraftState[CacheT], context: DraftContext) -> list[int]:
        """Roll the draft back to what it fed that is still committed; the committed
        tokens it has yet to feed (at least one: the logits come after it)."""
        tokens = context.token_ids
        common = common_prefix(state.fed, tokens)
        if common == len(tokens):  # must feed at least one token to get logits
            common -= 1
        self.model.rollback(state.cache, common)
        del state.fed[common:]
        return list(tokens[common:])

    def _step(self, states: list[ModelDraftState[CacheT]], feeds: list[list[int]]
              ) -> list[torch.Tensor]:
        """Each state's logits after its feed, ``[vocab]`` each (one batched pass)."""
        items = [BatchItem(s.cache, f, 1) for s, f in zip(states, feeds, strict=True)]
        outputs = self.model.forward_batch(items)
        for state, feed in zip(states, feeds, strict=True):
            state.fed.extend(feed)
        return [out[0] for out in outputs]

    def rollback(self, state: ModelDraftState[CacheT], length: int) -> None:
        if length < len(state.fed):
            self.model.rollback(state.cache, length)
            del state.fed[length:]

    def release(self, state: ModelDraftState[CacheT]) -> None:
        self.model.release(state.cache)
        state.fed.clear()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def fit_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:  # [vocab] -> [size]
    """Pad (with -inf) or trim draft logits to the target's vocabulary size."""
    if logits.shape[-1] == size:
        return logits
    if logits.shape[-1] > size:
        return logits[..., :size]
    pad = torch.full((size - logits.shape[-1],), float("-inf"), dtype=logits.dtype,
                     device=logits.device)
    return torch.cat([logits, pad])
