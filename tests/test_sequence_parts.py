"""The parts a sequence's decoder holds, each alone: its committed tokens and their text
(``Committed``), its prompt's prefill (``PromptPrefill``), the target's feature rows it
keeps (``FeatureRows.add_verified``) and its drafting (``SequenceDrafting``, ``Draft``)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pytest
import torch

from decoding.constrained import ConstrainedDraft
from decoding.drafter import BaseDrafter, DraftContext, DraftProposal
from decoding.drafting import Draft, SequenceDrafting
from decoding.features import FeatureRows
from decoding.policy import AdaptiveSpeculation, FixedSpeculation
from decoding.prefill import PromptPrefill
from decoding.prefix_cache import InProcessStore, PrefixCache
from decoding.text import Committed
from decoding.types import FinishReason, RoundTiming, SamplingParams
from decoding.verify import Verdict
from drafters.ngram import NgramDrafter
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import BatchItem

EOS = 256


class ByteTokenizer:
    """One token per byte of UTF-8 text; EOS (256) is a special token, without text."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _committed(max_new: int = 50, stop: Sequence[str] = ()) -> Committed:
    return Committed(ByteTokenizer(), [1, 2], frozenset({EOS}), max_new, stop)


# -- Committed: the committed tokens, their text and why they ended ------------------------


def test_a_stop_token_ends_the_output_and_drops_what_follows_it() -> None:
    out = _committed(stop=("zz",))
    new, text = out.add([*b"ab", EOS, *b"cd"])
    assert new == [*b"ab", EOS] and text == "ab"
    assert out.finish_reason is FinishReason.STOP and out.finished
    assert out.tokens == [1, 2, *b"ab", EOS] and out.output == [*b"ab", EOS]


def test_a_stop_string_across_rounds_is_cut_where_it_starts() -> None:
    out = _committed(stop=("world",))
    new, text = out.add(list(b"hello wo"))
    assert text == "hello " and not out.finished  # "wo" may start the stop string
    new, text = out.add(list(b"rld and more"))
    assert text == "" and out.finish_reason is FinishReason.STOP
    assert new == list(b"rld")  # the fewest tokens whose text holds the stop string
    assert out.output == list(b"hello world")


def test_the_length_cap_ends_the_output_and_releases_the_held_back_text() -> None:
    out = _committed(max_new=5, stop=("xyz",))
    new, text = out.add(list(b"abc"))
    assert text == "abc" and out.remaining == 2
    new, text = out.add(list(b"dxyz"))  # cut at the cap: "dx", whose "x" was held back
    assert new == list(b"dx") and text == "dx"
    assert out.finish_reason is FinishReason.LENGTH and out.remaining == 0


def test_an_incomplete_character_is_held_until_its_bytes_arrive() -> None:
    out = _committed()
    e_acute = "é".encode()
    assert out.add([*b"a", e_acute[0]]) == ([*b"a", e_acute[0]], "a")
    assert out.add([e_acute[1]]) == ([e_acute[1]], "é")
    assert out.add([*b"b", e_acute[0]])[1] == "b"
    assert out.flush() == "\ufffd"  # an output that ends now: the held text goes out


# -- PromptPrefill: the prompt's chunks, timing, log-probabilities and the prefix cache -----


def test_the_prompt_runs_in_chunks_and_only_the_last_keeps_a_row(tiny_target: CausalLM
                                                                  ) -> None:
    prompt = list(range(10, 18))
    prefill = PromptPrefill(prompt, None)
    state = tiny_target.new_state()  # (nothing is run: the chunks are only handed out)
    chunks = []
    while not chunks or not chunks[-1].final:
        chunk = prefill.next_chunk(tiny_target, state, 3)
        assert prefill.next_chunk(tiny_target, state, 3) == chunk  # until done
        chunks.append(chunk)
        prefill.done(chunk, 0.25, torch.zeros(prefill.kept_rows(chunk), 4))
    assert [list(c.tokens) for c in chunks] == [prompt[:3], prompt[3:6], prompt[6:]]
    assert [prefill.kept_rows(c) for c in chunks] == [0, 0, 1]
    assert prefill.prefilled == len(prompt) and prefill.seconds == pytest.approx(0.75)
    assert prefill.take_logprobs() == ()
    tiny_target.release(state)


def test_a_prompt_asked_for_its_log_probabilities_keeps_every_row() -> None:
    prompt = [3, 1, 4, 1, 5]
    prefill = PromptPrefill(prompt, None, top_logprobs=2)
    logits = torch.randn(len(prompt), 8, generator=torch.Generator().manual_seed(0))
    first = prefill.next_chunk(None, None, 2)  # type: ignore[arg-type]
    assert prefill.kept_rows(first) == 2
    prefill.done(first, 0.0, logits[:2])
    rest = prefill.next_chunk(None, None)  # type: ignore[arg-type]
    assert list(rest.tokens) == [4, 1, 5] and rest.final
    prefill.done(rest, 0.0, logits[2:])
    scored = prefill.take_logprobs()
    assert [s.token_id for s in scored] == prompt[1:]  # row i predicts token i + 1
    expected = torch.log_softmax(logits[:-1], dim=-1)[range(4), prompt[1:]]
    assert [s.logprob for s in scored] == pytest.approx(expected.tolist(), abs=1e-5)
    assert all(len(s.top) == 2 for s in scored)
    assert prefill.take_logprobs() == ()  # handed out once


class _CountingStore(InProcessStore):
    """The in-process store, counting its writes."""

    def __init__(self) -> None:
        super().__init__()
        self.puts = 0

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        self.puts += 1
        super().put_many(items)


def _prefill_into(target: CausalLM, prefill: PromptPrefill) -> object:
    state = target.new_state()
    while True:
        chunk = prefill.next_chunk(target, state)
        target.forward_batch([BatchItem(state, chunk.tokens, prefill.kept_rows(chunk))])
        prefill.done(chunk, 0.0, torch.zeros(0))
        if chunk.final:
            return state


def test_a_prompt_stores_its_blocks_once_and_the_next_starts_after_them(
        tiny_target: CausalLM) -> None:
    store = _CountingStore()
    cache = PrefixCache(store, namespace=uuid.uuid4().hex, block_tokens=4)
    prompt = list(range(100, 111))  # 11 tokens: two whole blocks before the last token
    first = PromptPrefill(prompt, cache)
    state = _prefill_into(tiny_target, first)
    assert first.cached_tokens == 0 and store.size_bytes == 0
    first.store(tiny_target, state)
    stored = store.puts
    assert stored > 0 and store.size_bytes > 0
    first.store(tiny_target, state)  # once only
    first.ended(tiny_target, state, prompt, FinishReason.TIMEOUT)
    assert store.puts == stored
    tiny_target.release(state)
    again = PromptPrefill(prompt, cache)
    state = tiny_target.new_state()
    assert list(again.next_chunk(tiny_target, state).tokens) == prompt[8:]
    assert again.cached_tokens == again.prefilled == 8
    tiny_target.release(state)
    asks = PromptPrefill(prompt, cache, top_logprobs=0)  # its prompt's rows are needed
    state = tiny_target.new_state()
    assert len(asks.next_chunk(tiny_target, state).tokens) == len(prompt)
    assert asks.cached_tokens == 0
    tiny_target.release(state)


def test_an_output_that_ends_at_a_stop_is_remembered_for_continuation_drafts(
        tiny_target: CausalLM) -> None:
    cache = PrefixCache(InProcessStore(), namespace=uuid.uuid4().hex, block_tokens=4)
    prompt = list(range(100, 111))
    output = list(range(200, 212))
    for reason, remembered in ((FinishReason.TIMEOUT, False), (FinishReason.STOP, True)):
        prefill = PromptPrefill(prompt, cache)
        state = _prefill_into(tiny_target, prefill)
        prefill.ended(tiny_target, state, [*prompt, *output], reason)
        tiny_target.release(state)
        assert bool(cache.continuation([*prompt, *output[:4]])) == remembered, reason


# -- FeatureRows: the rows of what verification kept ---------------------------------------


def test_feature_rows_keep_the_verified_rows_of_a_pass() -> None:
    rows = FeatureRows()
    rows.add(0, torch.zeros(5, 2))  # the prompt's: positions 0..4
    passed = torch.arange(10.0).reshape(5, 2)  # pending (position 4), 3 drafts, alternative
    rows.add_verified(4, passed, accepted=2, alternative_taken=False)
    assert (rows.start, rows.end) == (0, 7)  # the pending token's and two drafts'
    assert torch.equal(rows.get(4, 7), passed[:3])
    rows.add_verified(4, passed, accepted=0, alternative_taken=True)  # the round again
    assert rows.end == 6  # the pending token's and the alternative's, the drafts' forgotten
    assert torch.equal(rows.get(4, 6), passed[[0, 4]])


# -- SequenceDrafting: the drafter, its sources' policies, the judge -----------------------


class _Sources(BaseDrafter):
    """A drafter whose source for each round follows a script; it drafts nothing."""

    name = "scripted"

    def __init__(self, sources: Sequence[str]) -> None:
        self.sources = list(sources)
        self.asked = 0
        self.released: list[object] = []

    def begin(self, prompt_ids: object) -> dict[str, int]:
        return {"length": 0}

    def source(self, state: object, context: DraftContext) -> str:
        self.asked += 1
        return self.sources[self.asked - 1]

    def propose(self, state: object, context: DraftContext, k: int) -> DraftProposal:
        return DraftProposal.empty()

    def rollback(self, state: dict[str, int], length: int) -> None:
        state["length"] = length

    def release(self, state: object) -> None:
        self.released.append(state)


def _context() -> DraftContext:
    return DraftContext([1, 2, 3], SamplingParams(temperature=0.0), None)


def test_each_source_drafts_with_a_policy_of_its_own_capped_by_the_request() -> None:
    drafter = _Sources(["lookup", "model", "lookup"])
    made: list[str] = []

    def new_policy(source: str) -> AdaptiveSpeculation:
        made.append(source)
        return AdaptiveSpeculation()

    drafting = SequenceDrafting(drafter, [1, 2, 3], alternatives=False, features=False,
                                new_policy=new_policy, max_draft_tokens=3)
    for round_index in (1, 1, 2, 3):  # a round asks the drafter once
        drafting.choose_source(round_index, _context)
        drafting.policy.update(3, 3 if drafting.source == "lookup" else 0)
    assert drafter.asked == 3 and made == ["lookup", "model"]
    lookup, model = drafting.policies["lookup"], drafting.policies["model"]
    assert lookup.max_tokens == model.max_tokens == 3
    assert lookup.alpha > model.alpha  # the model's rejections stayed its own
    assert drafting.source_name == "lookup"
    drafting.source = ""
    assert drafting.source_name == "scripted"  # a drafter of one source: its own name


def test_a_shared_policy_serves_every_source() -> None:
    shared = FixedSpeculation(6)
    drafting = SequenceDrafting(_Sources(["lookup", "model"]), [1], alternatives=True,
                                features=True, policy=shared, max_draft_tokens=4)
    drafting.choose_source(1, _context)
    first = drafting.policy
    drafting.choose_source(2, _context)
    assert drafting.policy is first is shared and shared.max_tokens == 4
    assert drafting.features is not None and drafting.features.end == 0


class _AlwaysAlternative(FixedSpeculation):
    def worth_alternative(self, confidences: object, confidence: float) -> bool:
        return True


def test_the_judge_asks_the_drafting_source_s_policy_and_the_sequence_s_alternatives() -> None:
    for alternatives in (True, False):
        drafting = SequenceDrafting(_Sources([""]), [1], alternatives=alternatives,
                                    features=False, policy=_AlwaysAlternative(4))
        assert drafting.worth_proposing([0.01]) and drafting.worth_continuing([0.01])
        assert drafting.worth_alternative([0.5], 0.1) == alternatives
    calibrated = SequenceDrafting(_Sources([""]), [1], alternatives=True, features=False)
    for _ in range(40):  # confidence 0.95 accepted one time in three
        calibrated.policy.update(1, 0, confidences=(0.95,))
    assert not calibrated.worth_proposing([0.95, 0.95, 0.95, 0.95])


def test_a_real_drafter_proposes_rolls_back_and_is_released_once() -> None:
    prompt = [5, 6, 7, 8, 5, 6, 7]
    drafting = SequenceDrafting(NgramDrafter(), prompt, alternatives=False, features=False)
    context = DraftContext(prompt, SamplingParams(temperature=0.0), None, judge=drafting)
    assert drafting.propose(context, 2).tokens == (8, 5)  # what followed "5 6 7" before
    drafting.rollback(len(prompt))
    drafting.release()
    drafting.release()
    assert drafting.state is None
    scripted = _Sources([""])
    drafting = SequenceDrafting(scripted, prompt, alternatives=False, features=False)
    drafting.rollback(9)
    assert drafting.state == {"length": 9}
    drafting.release()
    drafting.release()
    assert scripted.released == [{"length": 9}]


class _Told(AdaptiveSpeculation):
    def __init__(self) -> None:
        super().__init__()
        self.told: list[tuple[object, ...]] = []

    def update(self, drafted: int, accepted: int, draft_s: float = 0.0,
               verify_s: float = 0.0, confidences: Sequence[float] = (),
               alternative: float | None = None, alternative_taken: bool = False) -> None:
        self.told.append((drafted, accepted, draft_s, verify_s, tuple(confidences),
                          alternative, alternative_taken))


def test_a_draft_tells_its_policy_of_its_own_tokens_not_the_grammar_s() -> None:
    policy = _Told()
    proposal = DraftProposal((7, 8, 9), confidence=(1.0, 0.8, 0.6, 0.3), alternative=4,
                             alternative_confidence=0.2)
    forced = ConstrainedDraft(proposal, forced=1)  # the grammar forced the first token
    draft = Draft((7, 8, 9), None, 4, proposal, 0.1, 0.0, policy, 1.5, forced)
    draft.learn(Verdict(accepted=2, next_token=5, bonus=False), RoundTiming(0.1, 0.2, 0.0))
    assert policy.told == [(2, 1, 0.1, 0.2, (0.8, 0.6, 0.3), 0.2, False)]
    plain = Draft((7,), None, None, DraftProposal((7,)), 0.0, 0.0, policy, None)
    plain.learn(Verdict(accepted=1, next_token=5, bonus=True), RoundTiming(0.0, 0.2, 0.0))
    assert policy.told[-1] == (1, 1, 0.0, 0.2, (), None, False)
    Draft((7,), None, None, DraftProposal((7,)), 0.0, 0.0, None, None).learn(
        Verdict(accepted=0, next_token=5, bonus=False), RoundTiming())  # no policy: no-op
