from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from decoding.drafter import BaseDrafter, DraftContext, DraftProposal
from decoding.prompting import encode_text
from decoding.round import decode, step
from decoding.sequence import SequenceDecoder
from decoding.types import GenerationRequest, SamplingParams
from drafters.combined import CombinedDrafter
from drafters.model import CHAIN_STEPS, ModelDrafter, TokenizerMismatchError
from drafters.ngram import NgramDrafter
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM, TransformersLM
from tests.policies import SteadyTimingPolicy

GREEDY = SamplingParams(temperature=0.0)


def test_ngram_proposes_the_continuation_of_the_latest_match() -> None:
    drafter = NgramDrafter(max_ngram=3, min_ngram=2)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 0, 2, 3]
    state = drafter.begin(tokens)
    proposal = drafter.propose(state, DraftContext(tokens, GREEDY, None), 3)
    # the latest "2 3" was followed by 7 8 0; it agrees on its n-gram alone, so it drafts
    # the shortest run
    assert proposal.tokens == (7, 8)
    assert proposal.probs is None


def test_ngram_drafts_as_far_ahead_as_its_match_agrees_behind() -> None:
    drafter = NgramDrafter(max_ngram=2, min_ngram=2)
    copied = list(range(100, 160))
    for agree in (2, 5, 12, 30):
        tokens = [*copied, 7, *copied[40 - agree : 40]]  # agrees on `agree` tokens behind
        proposal = drafter.propose(drafter.begin(tokens), DraftContext(tokens, GREEDY, None), 16)
        assert proposal.tokens == tuple(copied[40 : 40 + min(agree, 16)])


def test_ngram_follows_the_occurrence_that_shares_the_most_context() -> None:
    """Code repeats short n-grams everywhere: of the longest n-gram's occurrences, the one
    whose preceding tokens agree longest with the sequence's own is the one being copied,
    even where a later one exists; with equal context the latest wins."""
    drafter = NgramDrafter(max_ngram=2, min_ngram=2)
    copied = [11, 12, 13, 5, 6, 20, 21, 22]  # the passage being copied: "5 6" then 20 21 22
    elsewhere = [40, 5, 6, 30, 31, 32]  # a later, unrelated "5 6"
    tokens = [*copied, *elsewhere, 11, 12, 13, 5, 6]  # the answer copies the first passage
    state = drafter.begin(tokens)
    proposal = drafter.propose(state, DraftContext(tokens, GREEDY, None), 3)
    assert proposal.tokens == (20, 21, 22)
    tokens = [*copied, 40, 12, 13, 5, 6, 30, 31, 32, 13, 5, 6]  # both share "13 5 6"
    state = drafter.begin(tokens)
    assert drafter.propose(state, DraftContext(tokens, GREEDY, None), 3).tokens == (30, 31, 32)
    latest = NgramDrafter(max_ngram=2, min_ngram=2, context_match=2)  # no context compared
    tokens = [*copied, *elsewhere, 11, 12, 13, 5, 6]
    state = latest.begin(tokens)
    assert latest.propose(state, DraftContext(tokens, GREEDY, None), 3).tokens == (30, 31)


def test_ngram_drafts_exactly_k_tokens_where_fewer_than_its_run_are_asked() -> None:
    """The draft is as long as asked, never longer, for every k from 0 to 3: a match that
    agrees on its n-gram alone (a run of SHORTEST_RUN) and one that agrees far behind."""
    drafter = NgramDrafter(max_ngram=2, min_ngram=2)
    copied = list(range(100, 160))
    short = [*copied, 7, *copied[38:40]]  # agrees on the n-gram alone: a run of 2
    long = [*copied, 7, *copied[10:40]]  # agrees on 30 tokens behind
    for k in range(4):
        for tokens, run in ((short, 2), (long, 30)):
            proposal = drafter.propose(drafter.begin(tokens), DraftContext(tokens, GREEDY, None),
                                       k)
            assert proposal.tokens == tuple(copied[40 : 40 + min(k, run)]), (k, run)
            assert len(proposal.tokens) == min(k, run)


def test_ngram_compares_context_back_to_the_sequence_s_first_token() -> None:
    """An occurrence's context is compared down to position 0: the occurrence that agrees
    to the very start wins over a later one that agrees one token less."""
    drafter = NgramDrafter(max_ngram=2, min_ngram=2)
    tokens = [1, 2, 3, 4, 10, 11, 12, 13, 9, 2, 3, 4, 20, 21, 22, 23, 4, 1, 2, 3, 4]
    proposal = drafter.propose(drafter.begin(tokens), DraftContext(tokens, GREEDY, None), 16)
    assert proposal.tokens == (10, 11, 12, 13)  # agrees on 4: "1 2 3 4", back to token 0


def test_ngram_keeps_the_latest_16_occurrences_to_choose_from() -> None:
    """Of the n-gram's occurrences the 16 latest are compared: the oldest of 16 is followed
    where it shares the most context; as the oldest of 17 it is forgotten."""
    drafter = NgramDrafter(max_ngram=2, min_ngram=2)
    for later in (15, 16):
        head = [7, 8, 5, 6, 40, 41]  # the occurrence of "5 6" sharing "7 8" with the end
        fillers = [t for i in range(later) for t in (30 + i, 5, 6, 100 + i, 90)]
        tokens = [*head, *fillers, 7, 8, 5, 6]
        state = drafter.begin(tokens)
        drafter.propose(state, DraftContext(tokens[:-4], GREEDY, None), 4)  # indexed in two
        proposal = drafter.propose(state, DraftContext(tokens, GREEDY, None), 4)
        positions = state.occurrences[(5, 6)]
        assert len(set(positions)) == len(positions) == 16  # each occurrence once
        if later == 15:
            assert proposal.tokens == (40, 41, 30, 5)
        else:  # the latest of equals, agreeing on the n-gram alone
            assert proposal.tokens == (100 + later - 1, 90)


def test_ngram_falls_back_to_shorter_matches_in_a_short_sequence() -> None:
    """A sequence shorter than the longest n-gram still matches a shorter one, the first
    token included."""
    drafter = NgramDrafter(max_ngram=4, min_ngram=1)
    tokens = [5, 6, 5]
    assert drafter.propose(drafter.begin(tokens), DraftContext(tokens, GREEDY, None),
                           2).tokens == (6, 5)


def test_ngram_rolls_back_past_what_it_indexed() -> None:
    """A roll-back below what was indexed forgets it: an n-gram of tokens rolled back no
    longer matches, and one written again does."""
    drafter = NgramDrafter(max_ngram=2, min_ngram=2)
    tokens = [1, 2, 3, 4, 1, 2]
    state = drafter.begin(tokens)
    assert drafter.propose(state, DraftContext(tokens, GREEDY, None), 2).tokens == (3, 4)
    tokens = [*tokens, 3]
    assert drafter.propose(state, DraftContext(tokens, GREEDY, None), 2).tokens == (4, 1)
    assert state.occurrences[(1, 2)] == [2, 6]  # each once, though indexed in two calls
    drafter.rollback(state, len(tokens))  # nothing rolled back: the index stays
    assert state.indexed == len(tokens)
    drafter.rollback(state, 2)
    assert (state.indexed, state.occurrences) == (0, {})
    assert all(table == {} for table in state.index.values())
    tokens = [1, 2, 7, 8, 1, 2]
    assert drafter.propose(state, DraftContext(tokens, GREEDY, None), 2).tokens == (7, 8)


def test_ngram_refuses_lengths_out_of_order() -> None:
    for low, high in ((0, 2), (3, 2)):
        with pytest.raises(ValueError, match=r"^need 1 <= min_ngram <= max_ngram$"):
            NgramDrafter(max_ngram=high, min_ngram=low)


def test_ngram_continues_a_repetition_past_the_end() -> None:
    drafter = NgramDrafter(max_ngram=2, min_ngram=2)
    tokens = [9, 1, 2, 3, 1, 2, 3, 1, 2]  # period 3: the latest "1 2" starts 3 back
    proposal = drafter.propose(drafter.begin(tokens), DraftContext(tokens, GREEDY, None), 7)
    assert proposal.tokens == (3, 1, 2, 3, 1)  # as far as the repetition agrees behind


def test_ngram_prefers_longer_matches_and_never_matches_itself() -> None:
    drafter = NgramDrafter(max_ngram=3, min_ngram=1)
    state = drafter.begin([])
    assert drafter.propose(state, DraftContext([5, 6, 7], GREEDY, None), 4).tokens == ()
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    assert drafter.propose(state, DraftContext(tokens, GREEDY, None), 2).tokens == (4, 9)


def test_model_drafter_rollback_reuses_the_committed_prefix(tiny_target: BatchedLM) -> None:
    drafter = ModelDrafter(tiny_target, tiny_target)
    tokens = [10, 11, 12, 13]
    state = drafter.begin(tokens)
    first = drafter.propose(state, DraftContext(tokens, GREEDY, None), 4)
    assert len(first.tokens) == 4
    assert state.cache.length == len(tokens) + 3
    committed = [*tokens, first.tokens[0], 999]  # one accepted, then a recovered token
    drafter.rollback(state, len(committed))
    second = drafter.propose(state, DraftContext(committed, GREEDY, None), 2)
    fresh_state = drafter.begin(committed)
    fresh = drafter.propose(fresh_state, DraftContext(committed, GREEDY, None), 2)
    assert second.tokens == fresh.tokens
    drafter.release(state)
    drafter.release(fresh_state)
    assert tiny_target.rows_in_use == 0


def test_model_drafter_sampling_returns_its_distribution(tiny_target: CausalLM) -> None:
    import torch

    drafter = ModelDrafter(tiny_target, tiny_target)
    params = SamplingParams(temperature=0.8, top_k=20)
    generator = torch.Generator().manual_seed(0)
    state = drafter.begin([1, 2])
    proposal = drafter.propose(state, DraftContext([1, 2], params, generator), 3)
    drafter.release(state)
    assert proposal.probs is not None and proposal.probs.shape == (3, tiny_target.vocab_size)
    for i, token in enumerate(proposal.tokens):
        assert proposal.probs[i, token] > 0
        assert int((proposal.probs[i] > 0).sum()) <= 20


class _Judge:
    """Lets the first ``keep`` draft tokens through; ``go_on`` says whether to draft on,
    ``alternative`` whether to verify the second choice for the first token too."""

    def __init__(self, keep: int, go_on: bool = True, alternative: bool = False) -> None:
        self.keep, self.go_on, self.alternative = keep, go_on, alternative
        self.asked: list[tuple[tuple[float, ...], float]] = []

    def worth_proposing(self, confidences: Sequence[float]) -> bool:
        return len(confidences) <= self.keep

    def worth_continuing(self, confidences: Sequence[float]) -> bool:
        return self.go_on

    def worth_alternative(self, confidences: Sequence[float], confidence: float) -> bool:
        self.asked.append((tuple(confidences), confidence))
        return self.alternative


@pytest.mark.parametrize("chain", [False, True], ids=["steps", "native-chain"])
def test_model_drafter_reports_its_confidence_and_drafts_as_far_as_its_judge_says(
        tiny_target: BatchedLM, tiny_reference: CausalLM, chain: bool) -> None:
    """By the step loop or the native chain: the same drafts, cut where the judge says.
    The loop stops feeding where the judge stops it; the chain feeds back all but the
    last of the tokens its call drafted (``CHAIN_STEPS`` at most)."""
    import torch

    drafter = ModelDrafter(tiny_target, tiny_target)
    drafter.native_chain = chain
    assert drafter.can_chain() == chain
    tokens = [10, 11, 12, 13]
    state = drafter.begin(tokens)
    free = drafter.propose(state, DraftContext(tokens, GREEDY, None), 5)
    drafter.release(state)
    assert len(free.tokens) == 5 and len(free.confidence) == 5
    with torch.inference_mode():
        logits = tiny_reference.model(torch.tensor([tokens])).logits[0, -1].float()
    assert free.confidence[0] == pytest.approx(float(torch.softmax(logits, -1).max()), rel=1e-3)
    assert all(0 < c <= 1 for c in free.confidence)

    state = drafter.begin(tokens)
    judged = drafter.propose(state, DraftContext(tokens, GREEDY, None, _Judge(keep=2)), 5)
    assert judged.tokens == free.tokens[:2]  # the third was drafted, then withheld
    assert judged.confidence == pytest.approx(free.confidence[:3], rel=1e-3)
    assert state.cache.length == len(tokens) + (CHAIN_STEPS - 1 if chain else 2)
    drafter.release(state)

    state = drafter.begin(tokens)  # told not to go on: no step beyond the first token
    short = drafter.propose(state, DraftContext(tokens, GREEDY, None, _Judge(5, False)), 5)
    assert short.tokens == free.tokens[:1] and len(short.confidence) == 1
    assert state.cache.length == len(tokens) + (CHAIN_STEPS - 1 if chain else 0)
    drafter.release(state)
    assert tiny_target.rows_in_use == 0
    assert free.alternative is None and short.alternative is None  # no judge / judge says no


def test_a_chained_round_drafts_one_step_past_what_the_judge_let_through_before(
        tiny_target: BatchedLM) -> None:
    """A round's first native call makes one step more than the judge kept the round
    before (a judge that keeps one token wastes one step a round, not three); a round
    that wants more drafts on in a further call, with the same tokens."""
    drafter = ModelDrafter(tiny_target, tiny_target)
    assert drafter.can_chain()
    tokens = [10, 11, 12, 13]
    reference = drafter.begin(tokens)
    free = drafter.propose(reference, DraftContext(tokens, GREEDY, None), 6)
    drafter.release(reference)
    state = drafter.begin(tokens)
    one = drafter.propose(state, DraftContext(tokens, GREEDY, None, _Judge(keep=1)), 6)
    assert one.tokens == free.tokens[:1] and state.judged == 1
    assert state.cache.length == len(tokens) + CHAIN_STEPS - 1  # the first round: 4 steps
    again = drafter.propose(state, DraftContext(tokens, GREEDY, None, _Judge(keep=1)), 6)
    assert again.tokens == free.tokens[:1]
    assert state.cache.length == len(tokens) + 1  # two steps: one fed back
    more = drafter.propose(state, DraftContext(tokens, GREEDY, None, _Judge(keep=9)), 6)
    assert more.tokens == free.tokens and state.judged == 6  # calls of 2 then 4 steps
    assert state.cache.length == len(tokens) + 5
    drafter.release(state)
    assert tiny_target.rows_in_use == 0


CHAIN_MODELS = {"dense-float32": ("float32", "none"), "blocks-bfloat16": ("bfloat16", "int4")}


@pytest.mark.parametrize("model", list(CHAIN_MODELS))
def test_the_native_chain_drafts_the_step_loop_s_tokens(tiny_target_dir: Path,
                                                        model: str) -> None:
    """Several sequences at once, each with its own catch-up and draft length, over
    rounds whose committed tokens partly differ from the drafts: the chain's proposals
    (tokens, second choice) are the step loop's, their confidences equal to a few ulp,
    and a sequence that switches path mid-way keeps drafting the same."""
    dtype, quantize = CHAIN_MODELS[model]
    runner = BatchedLM.load(str(tiny_target_dir), dtype=dtype, quantize=quantize)
    assert isinstance(runner, BatchedLM)
    drafter = ModelDrafter(runner, runner)
    judge = _Judge(keep=9, alternative=True)
    assert drafter.can_chain()

    def rounds(paths: list[bool]) -> list[list[DraftProposal]]:
        prompts = [[10, 11, 12, 13], list(range(40, 75)), [7]]
        states = [drafter.begin(p) for p in prompts]
        out = []
        for chain in paths:
            drafter.native_chain = chain
            contexts = [DraftContext(p, GREEDY, None, judge) for p in prompts]
            proposals = drafter.propose_many(states, contexts, [5, 3, 1])
            out.append(proposals)
            # the first draft token accepted, then a token of the target's own
            prompts = [[*p, *q.tokens[:1], 500 + len(p)] for p, q in zip(prompts, proposals,
                                                                          strict=True)]
        for state in states:
            drafter.release(state)
        return out

    steps, chained, mixed = rounds([False] * 4), rounds([True] * 4), rounds([True, False] * 2)
    assert runner.rows_in_use == 0
    for a, b, c in zip(steps, chained, mixed, strict=True):
        for x, y, z in zip(a, b, c, strict=True):
            assert x.tokens == y.tokens == z.tokens and len(x.tokens) >= 1
            assert x.alternative == y.alternative == z.alternative is not None
            assert y.confidence == pytest.approx(x.confidence, rel=1e-5)
            assert y.alternative_confidence == pytest.approx(x.alternative_confidence, rel=1e-5)


def test_sampled_rounds_keep_the_step_loop_beside_a_native_chain(
        tiny_target: BatchedLM) -> None:
    """A sampled sequence drafts by the step loop (its distribution comes back), a greedy
    one beside it in the same call by the chain."""
    import torch

    drafter = ModelDrafter(tiny_target, tiny_target)
    assert drafter.can_chain()
    states = [drafter.begin([1, 2]), drafter.begin([3, 4])]
    sampled = DraftContext([1, 2], SamplingParams(temperature=0.8),
                           torch.Generator().manual_seed(0))
    greedy = DraftContext([3, 4], GREEDY, None)
    proposals = drafter.propose_many(states, [sampled, greedy], [3, 3])
    assert proposals[0].probs is not None and proposals[0].probs.shape[0] == 3
    assert proposals[1].probs is None and len(proposals[1].tokens) == 3
    assert states[0].cache.length == 2 + 2 and states[1].cache.length == 2 + 2
    for state in states:
        drafter.release(state)


def test_a_drafter_with_steps_of_its_own_never_chains(tiny_target: BatchedLM) -> None:
    """A subclass that feeds its own rows each step (a feature head) keeps its steps."""

    class OwnSteps(ModelDrafter):
        def _step(self, states: Any, feeds: Any) -> Any:
            return super()._step(states, feeds)

    assert ModelDrafter(tiny_target, tiny_target).can_chain()
    assert not OwnSteps(tiny_target, tiny_target).can_chain()


@pytest.mark.real_model
def test_the_shipped_draft_chains_natively_and_drafts_its_step_loop_s_tokens(
        default_model_dir: Path) -> None:
    """The shipped draft beside the served target (its head over part of the vocabulary,
    the target's 4-bit embedding rows): the chain runs, with the step loop's tokens."""
    from runtime.loaders.loading import load_target
    from wiring.drafts import load_model_drafter

    target = load_target("default", "bfloat16", quantize="auto")
    drafter = load_model_drafter("default-draft", target, "bfloat16")
    assert isinstance(drafter, ModelDrafter) and drafter.can_chain()
    prompt = encode_text(target.tokenizer, "The three primary colours are")
    drafted = {}
    for chain in (False, True):
        drafter.native_chain = chain
        state = drafter.begin(prompt)
        drafted[chain] = drafter.propose(state, DraftContext(prompt, GREEDY, None), 6)
        drafter.release(state)
    assert drafted[True].tokens == drafted[False].tokens and len(drafted[True].tokens) == 6
    assert drafted[True].confidence == pytest.approx(drafted[False].confidence, rel=1e-5)


def test_model_drafter_offers_its_second_choice_for_the_first_token(
        tiny_target: BatchedLM, tiny_reference: CausalLM) -> None:
    import torch

    drafter = ModelDrafter(tiny_target, tiny_target)
    tokens = [10, 11, 12, 13]
    with torch.inference_mode():
        logits = tiny_reference.model(torch.tensor([tokens])).logits[0, -1].float()
        probs = torch.softmax(logits, -1)
    top = torch.topk(probs, 2)
    judge = _Judge(keep=2, alternative=True)
    state = drafter.begin(tokens)
    proposal = drafter.propose(state, DraftContext(tokens, GREEDY, None, judge), 5)
    drafter.release(state)
    assert proposal.tokens[0] == int(top.indices[0])
    assert proposal.alternative == int(top.indices[1]) != proposal.tokens[0]
    assert proposal.alternative_confidence == pytest.approx(float(top.values[1]), rel=1e-3)
    # judged once, after drafting, on the proposed tokens' confidences (not the withheld one)
    assert len(judge.asked) == 1 and len(judge.asked[0][0]) == len(proposal.tokens) == 2
    assert judge.asked[0][0] == pytest.approx(proposal.confidence[:2])

    sampled = SamplingParams(temperature=1.0)  # sampling: never an alternative
    state = drafter.begin(tokens)
    proposal = drafter.propose(
        state, DraftContext(tokens, sampled, torch.Generator().manual_seed(0),
                            _Judge(keep=5, alternative=True)), 3)
    drafter.release(state)
    assert proposal.alternative is None


def test_sampled_drafts_are_judged_by_their_distribution_never_by_the_draw(
        tiny_target: CausalLM) -> None:
    """Withholding a sampled token for being unlikely would change which tokens reach
    verification, and the output would no longer follow the target's distribution; a
    confidence that depends on the distribution alone keeps the decision blind to it."""
    import torch

    drafter = ModelDrafter(tiny_target, tiny_target)
    params = SamplingParams(temperature=1.5, top_k=50)
    for seed in range(3):
        state = drafter.begin([1, 2])
        context = DraftContext([1, 2], params, torch.Generator().manual_seed(seed), _Judge(9))
        proposal = drafter.propose(state, context, 4)
        drafter.release(state)
        assert proposal.probs is not None
        for row, confidence in zip(proposal.probs, proposal.confidence, strict=True):
            assert confidence == pytest.approx(float(row.max()))


def test_mismatched_tokenizer_is_refused(
    tiny_target: CausalLM, tiny_draft_dir: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_draft_dir)
    tokenizer.add_tokens(["<extra-token-a>", "<extra-token-b>"])
    draft = TransformersLM.load(str(tiny_draft_dir))
    draft.tokenizer = tokenizer
    with pytest.raises(TokenizerMismatchError, match="does not share the target's tokenizer"):
        ModelDrafter(draft, tiny_target)


class _Scripted(BaseDrafter):
    """Drafts the next tokens of a known continuation, optionally with a wrong first one."""

    def __init__(self, name: str, truth: list[int], wrong_first: bool) -> None:
        self.name, self.truth, self.wrong_first = name, truth, wrong_first
        self.calls = 0

    def begin(self, prompt_ids: object) -> None:
        return None

    def propose(self, state: None, context: DraftContext, k: int) -> DraftProposal:
        self.calls += 1
        at = len(context.token_ids)
        tokens = list(self.truth[at : at + k])
        if self.wrong_first:
            tokens[0] += 1
        return DraftProposal(tokens=tuple(tokens))

    def rollback(self, state: None, length: int) -> None:
        pass

    def release(self, state: None) -> None:
        pass


def _rounds(drafter: CombinedDrafter, truth: list[int], rounds: int) -> list[tuple[int, ...]]:
    """Propose, then commit one true token, ``rounds`` times; the proposals made."""
    state = drafter.begin(truth[:1])
    made = []
    for n in range(1, rounds + 1):
        made.append(drafter.propose(state, DraftContext(truth[:n], GREEDY, None), 3).tokens)
    drafter.release(state)
    return made


def test_combined_hands_rounds_to_the_model_when_lookup_keeps_missing() -> None:
    truth = list(range(100, 200))
    lookup = _Scripted("lookup", truth, wrong_first=True)
    model = _Scripted("model", truth, wrong_first=False)
    combined = CombinedDrafter([lookup], model)
    made = _rounds(combined, truth, 12)
    assert made[0] == (102, 102, 103)  # nothing measured yet: the free proposal first
    assert made[-1] == tuple(truth[12:15]), "the model drafts once lookup has been measured worse"
    assert lookup.calls == 12, "lookup still proposes (and is scored) every round"
    # a new request starts from what this one measured: the model from the first round
    model.calls = 0
    assert _rounds(combined, truth, 3)[0] == (101, 102, 103)
    assert model.calls == 3


def test_combined_keeps_lookup_when_it_is_right() -> None:
    truth = list(range(100, 200))
    lookup = _Scripted("lookup", truth, wrong_first=False)
    model = _Scripted("model", truth, wrong_first=True)
    combined = CombinedDrafter([lookup], model)
    assert _rounds(combined, truth, 10) == [tuple(truth[n : n + 3]) for n in range(1, 11)]
    assert model.calls == 0, "a model is not run while free lookup proposals are right"


class _Sometimes(_Scripted):
    """Right, but finds something only in the first half of every ten positions (as
    lookup finds a passage to copy now and then)."""

    def propose(self, state: None, context: DraftContext, k: int) -> DraftProposal:
        if len(context.token_ids) % 10 >= 5:
            self.calls += 1
            return DraftProposal.empty()
        return super().propose(state, context, k)


def test_each_source_keeps_a_draft_length_of_its_own(tiny_target: CausalLM) -> None:
    """Lookup, always right where it finds something, drafts long runs although the
    model it alternates with is always wrong: the model's rejections shorten (and stop)
    the model's drafts only. Output stays the target's own."""
    prompt = tuple(encode_text(tiny_target.tokenizer, "Hello"))
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=120, sampling=GREEDY)
    plain = [t for event in decode(tiny_target, None, request) for t in event.token_ids]
    truth = [*prompt, *plain]
    lookup = _Sometimes("lookup", truth, wrong_first=False)
    model = _Scripted("model", truth, wrong_first=True)
    combined = CombinedDrafter([lookup], model)
    # (timings told, not measured: on a loaded machine measured ones decide the lengths)
    decoder = SequenceDecoder(tiny_target, combined, request,
                              new_policy=lambda source: SteadyTimingPolicy())
    rounds = []
    while not decoder.finished:
        event = step(decoder)
        rounds.append((decoder.drafting.source, event))
    assert [t for _, event in rounds for t in event.token_ids] == plain
    assert set(decoder.drafting.policies) == {"lookup", "model"}
    later = rounds[len(rounds) // 2 :]
    assert max(e.draft_tokens for source, e in later if source == "lookup") >= 4, \
        "lookup's drafts were cut short by the model's rejections"
    # (two: a pass verifying one draft costs what a one-token step does, since every
    # attention block has two queries a row, so one rejected draft is nearly free)
    assert max(e.draft_tokens for source, e in later if source == "model") <= 2, \
        "the model kept drafting long runs on lookup's record"
    assert decoder.drafting.policies["lookup"].alpha > 0.9
    assert decoder.drafting.policies["model"].alpha < 0.5
    # the fake model drafts for free, so its measured cost is timing noise: at what a real
    # draft model's token costs (a tenth of a step) its drafts stop paying
    model_policy = decoder.drafting.policies["model"]
    model_policy.cost.draft_per_token = max(model_policy.cost.draft_per_token, 0.1)
    assert model_policy.best_k() == 0, "the model's drafts stop paying"
    assert all(e.accepted_tokens == e.draft_tokens for s, e in rounds if s == "lookup")
    # the source was chosen before the round's length, and lookup proposed once per round
    assert lookup.calls == len(rounds) - 1


def test_a_draft_runs_in_bfloat16_beside_a_float32_target_where_the_cpu_has_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.loaders import loading

    monkeypatch.setattr(loading, "cpu_has_bf16", lambda: True)
    assert loading.torch_draft_dtype("float32", "cpu") == "bfloat16"
    assert loading.torch_draft_dtype("float32", "cpu", "float32") == "float32"
    assert loading.torch_draft_dtype("bfloat16", "cpu") == "bfloat16"
    assert loading.torch_draft_dtype("float32", "cuda") == "float32"  # a GPU: as the target
    monkeypatch.setattr(loading, "cpu_has_bf16", lambda: False)  # emulated: slower, so not
    assert loading.torch_draft_dtype("float32", "cpu") == "float32"
    assert loading.torch_draft_dtype("float32", "cpu", "bfloat16") == "bfloat16"  # as asked
    with pytest.raises(ValueError, match="draft dtype"):
        loading.torch_draft_dtype("float32", "cpu", "float8")


@pytest.mark.real_model
def test_the_draft_steps_benchmark_writes_its_table_and_json(
        default_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import torch

    from specbench import draft_steps

    out = tmp_path / "draft-steps.json"
    before = torch.get_num_threads()
    try:
        assert draft_steps.main(["--k", "3", "--streams", "2", "--rounds", "1",
                                 "--repeats", "2", "--threads", "1", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(before)
    report = json.loads(out.read_text())
    assert {(r["path"], r["streams"]) for r in report["rows"]} == {
        ("python", 1), ("native", 1), ("python", 2), ("native", 2)}
    assert all(r["ms_per_drafted_token"] > 0 for r in report["rows"])
    assert report["target_step_ms"] > 0
    assert "native | 2 | 3 |" in capsys.readouterr().out


@pytest.mark.real_model
def test_the_draft_steps_benchmark_times_a_feature_head_by_both_paths(
        default_model_dir: Path, tmp_path: Path) -> None:
    """The shipped feature head, fed the target's states: both paths draft the same
    tokens (the script stops otherwise) and both are timed."""
    import json

    import torch

    from specbench import draft_steps

    out = tmp_path / "feature-steps.json"
    before = torch.get_num_threads()
    try:
        assert draft_steps.main(["--draft", "feature-draft", "--k", "3", "--streams", "2",
                                 "--rounds", "1", "--repeats", "2", "--threads", "1",
                                 "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(before)
    report = json.loads(out.read_text())
    assert report["draft"] == "feature-draft"
    assert {r["path"] for r in report["rows"]} == {"python", "native"}

