"""Predicted outputs: the prediction drafter follows an answer through edits and
hands its rounds to the server's drafter where the prediction is unrelated; on the
default model, through the engine, a prediction changes no greedy token, no seeded
sampled token and no log-probability; a prediction's usage counts are a diff's."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

import pytest

from decoding.drafter import BaseDrafter, DraftContext, DraftProposal
from decoding.engine import Engine
from decoding.prompting import encode_chat, encode_text
from decoding.types import GenerationRequest, RoundEvent, SamplingParams, TokenLogprob
from drafters.ngram import NgramDrafter
from drafters.prediction import SOURCE, PredictionDrafter, PredictionState
from gateway.encode.totals import common_length
from runtime.loaders.loading import load_target
from runtime.runner.causal_lm import CausalLM

GREEDY = SamplingParams(temperature=0.0)
PROMPT = (1, 2, 3)
PREDICTION = tuple(range(100, 160))  # 60 distinct tokens: every run occurs once


def _textbook_lcs(a: Sequence[int], b: Sequence[int]) -> int:
    previous = [0] * (len(b) + 1)
    for x in a:
        row = [0]
        for j, y in enumerate(b):
            row.append(previous[j] + 1 if x == y else max(previous[j + 1], row[j]))
        previous = row
    return previous[-1]


def test_the_prediction_s_tokens_in_the_answer_are_the_longest_common_subsequence() -> None:
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(5) for _ in range(rng.randrange(0, 40))]
        b = [rng.randrange(5) for _ in range(rng.randrange(0, 40))]
        assert common_length(a, b) == _textbook_lcs(a, b), (a, b)
    assert common_length(list(range(50)), list(range(50))) == 50
    assert common_length([1, 2, 3], [4, 5]) == 0


def _context(answer: Sequence[int]) -> DraftContext:
    return DraftContext((*PROMPT, *answer), GREEDY, None)


def _next(drafter: PredictionDrafter, state: PredictionState, answer: Sequence[int],
          k: int = 4) -> tuple[str, tuple[int, ...]]:
    context = _context(answer)
    return drafter.source(state, context), drafter.propose(state, context, k).tokens


def test_it_drafts_from_the_first_round_as_far_as_the_answer_agrees() -> None:
    """From the first token on, at least two tokens, and no further ahead than the
    answer has agreed with the prediction behind (nor than asked)."""
    drafter = PredictionDrafter(PREDICTION)
    state = drafter.begin(PROMPT)
    assert _next(drafter, state, PREDICTION[:1]) == (SOURCE, PREDICTION[1:3])
    assert _next(drafter, state, PREDICTION[:3]) == (SOURCE, PREDICTION[3:6])
    assert _next(drafter, state, PREDICTION[:6], k=2) == (SOURCE, PREDICTION[6:8])
    assert _next(drafter, state, PREDICTION[:12], k=8) == (SOURCE, PREDICTION[12:20])
    assert _next(drafter, state, PREDICTION[:13], k=0) == (SOURCE, ())


@pytest.mark.parametrize(("answer", "rejoined"), [
    # a line inserted after the 10th token: the answer goes on from the 11th
    ((*PREDICTION[:10], 7, 8, 9, *PREDICTION[10:13]), 13),
    # tokens 10-19 dropped: the answer goes on from the 20th
    ((*PREDICTION[:10], *PREDICTION[20:23]), 23),
    # the 10th token renamed (one token for another)
    ((*PREDICTION[:10], 7, *PREDICTION[11:14]), 14),
], ids=["inserted", "dropped", "renamed"])
def test_it_finds_where_the_answer_rejoins_the_prediction(
        answer: tuple[int, ...], rejoined: int) -> None:
    drafter = PredictionDrafter(PREDICTION)
    state = drafter.begin(PROMPT)
    _next(drafter, state, answer[:10])
    # off the prediction: nothing to draft from it (no drafter beside it)
    assert _next(drafter, state, answer[:11]) == (SOURCE, ())
    # back on it three tokens after the edit: it drafts from there, three tokens ahead
    assert _next(drafter, state, answer) == (SOURCE, PREDICTION[rejoined:rejoined + 3])


def test_a_run_that_recurs_rejoins_after_the_last_match_first() -> None:
    repeated = (7, 8, 9)
    prediction = (*repeated, 10, 11, 12, 13, *repeated, 20, 21, 22, *repeated, 30, 31)
    drafter = PredictionDrafter(prediction)
    state = drafter.begin(PROMPT)
    # the answer has followed the prediction past its second (7, 8, 9), then left it
    answer = [*prediction[:12], 99, *repeated]
    assert _next(drafter, state, answer[:12])[1] == prediction[12:16]
    assert _next(drafter, state, answer)[1] == (30, 31)  # the third (7, 8, 9), not the first
    # with nothing after the last match, the nearest before it
    state = drafter.begin(PROMPT)
    late = [*prediction, 99, *repeated]
    _next(drafter, state, prediction)
    assert _next(drafter, state, late)[1] == (30, 31)


def test_runs_shorter_than_three_tokens_do_not_rejoin() -> None:
    drafter = PredictionDrafter(PREDICTION)
    state = drafter.begin(PROMPT)
    answer = (*PREDICTION[:10], 7, *PREDICTION[11:13])  # two tokens back on the prediction
    _next(drafter, state, answer[:10])
    assert _next(drafter, state, answer) == (SOURCE, ())


def test_the_server_s_drafter_drafts_where_the_prediction_is_off() -> None:
    repeating = (5, 6, 7, 8) * 6  # lookup finds it repeating
    drafter = PredictionDrafter(PREDICTION, NgramDrafter())
    state = drafter.begin(PROMPT)
    source, tokens = _next(drafter, state, repeating)
    assert source == "ngram" and tokens == (5, 6, 7, 8)
    # back on the prediction (three tokens of it): the prediction drafts again
    source, tokens = _next(drafter, state, (*repeating, *PREDICTION[30:33]))
    assert (source, tokens) == (SOURCE, PREDICTION[33:36])
    # and at its end lookup takes over once more
    _, tokens = _next(drafter, state, (*repeating, *PREDICTION[30:]))
    assert tokens == ()


def test_an_unrelated_prediction_hands_its_rounds_to_the_server_s_drafter() -> None:
    """A prediction whose runs the answer meets, but whose continuations it never
    takes, drafts a round or two and then leaves them to lookup."""
    prediction = tuple(t for run in range(12) for t in (40 + run, 41 + run, 42 + run, 90))
    drafter = PredictionDrafter(prediction, NgramDrafter())
    state = drafter.begin(PROMPT)
    answer: list[int] = []
    sources = []
    for run in range(12):  # each of the prediction's runs, followed by other tokens
        answer += [40 + run, 41 + run, 42 + run]
        sources.append(_next(drafter, state, answer)[0])
        answer += [70, 71]
        _next(drafter, state, answer)
    assert sources[0] == SOURCE
    assert set(sources[4:]) == {"ngram"}, sources


def test_where_lookup_disagrees_and_has_been_right_lookup_drafts() -> None:
    """A name the answer changes everywhere (52 to 60): the prediction says the old name
    where lookup, reading the answer's own text, says the new one; the prediction drafts
    the first such dispute, and once lookup has been right in one, lookup drafts."""
    s, t, old, new = 50, 51, 52, 60
    prediction = (40, 41, 42, 43, s, t, old, 53, s, t, old, 54, s, t, old, 55)
    answer = (40, 41, 42, 43, s, t, new, 53, s, t, new, 54, s, t, new, 55)
    drafter = PredictionDrafter(prediction, NgramDrafter())
    state = drafter.begin(PROMPT)
    assert _next(drafter, state, answer[:4]) == (SOURCE, (s, t, old, 53))
    assert _next(drafter, state, answer[:8])[0] == "ngram"  # off the prediction
    # (53, s, t) rejoins it before its second old name, where lookup says the new one
    assert _next(drafter, state, answer[:10]) == (SOURCE, (old, 54, s))
    _next(drafter, state, answer[:12])  # the answer took lookup's
    source, tokens = _next(drafter, state, answer[:14])
    assert source == "ngram" and tokens[0] == new


def test_an_empty_prediction_is_refused() -> None:
    with pytest.raises(ValueError, match="a prediction needs at least one token"):
        PredictionDrafter(())


class _Scripted(BaseDrafter[list]):
    """The server's drafter beside the prediction: proposes what ``script`` says for the
    answer so far, names ``source``, and records what it was asked."""

    def __init__(self, script: Callable[[tuple[int, ...]], tuple[int, ...]],
                 source: str = "model", reads_features: bool = False) -> None:
        self.script = script
        self.name = source
        self.reads_features = reads_features
        self.warmed = 0

    def begin(self, prompt_ids: Sequence[int]) -> list:
        return [("begin", tuple(prompt_ids))]

    def source(self, state: list, context: DraftContext) -> str:
        state.append(("source", len(context.token_ids)))
        return self.name

    def propose(self, state: list, context: DraftContext, k: int) -> DraftProposal:
        return DraftProposal(self.script(tuple(context.token_ids[len(PROMPT):]))[:k])

    def warmup(self) -> None:
        self.warmed += 1

    def rollback(self, state: list, length: int) -> None:
        state.append(("rollback", length))

    def release(self, state: list) -> None:
        state.append(("release",))


def test_it_names_and_reads_what_the_drafter_it_wraps_does() -> None:
    alone = PredictionDrafter(PREDICTION)
    assert (alone.name, alone.reads_features) == (SOURCE, False)
    inner = _Scripted(lambda answer: (), source="eagle", reads_features=True)
    wrapped = PredictionDrafter.around(PREDICTION, inner)
    assert (wrapped.prediction, wrapped.inner) == (PREDICTION, inner)
    assert (wrapped.name, wrapped.reads_features) == ("eagle", True)
    assert PredictionDrafter(PREDICTION, _Scripted(lambda answer: ())).reads_features is False


def test_the_wrapped_drafter_is_begun_warmed_rolled_back_and_released_with_it() -> None:
    inner = _Scripted(lambda answer: (7,))
    drafter = PredictionDrafter(PREDICTION, inner)
    drafter.warmup()
    assert inner.warmed == 1
    state = drafter.begin(PROMPT)
    assert state.inner == [("begin", PROMPT)]
    assert _next(drafter, state, (5, 6)) == ("model", (7,))  # off the prediction
    drafter.rollback(state, len(PROMPT) + 1)
    drafter.release(state)
    assert state.inner[-2:] == [("rollback", len(PROMPT) + 1), ("release",)]
    assert state.index == {}  # the request's table dropped (it is shared, never cleared)


def test_after_a_rollback_below_what_it_followed_it_follows_the_answer_afresh() -> None:
    drafter = PredictionDrafter(PREDICTION)
    state = drafter.begin(PROMPT)
    assert _next(drafter, state, PREDICTION[:12])[1] == PREDICTION[12:16]
    drafter.rollback(state, len(PROMPT))
    # a new answer that opens with other text, then starts the prediction
    assert _next(drafter, state, (5, 6, *PREDICTION[:2])) == (SOURCE, PREDICTION[2:4])
    drafter.rollback(state, len(PROMPT))
    assert _next(drafter, state, ()) == (SOURCE, PREDICTION[:2])
    drafter.rollback(state, len(PROMPT))
    assert _next(drafter, state, (5,) * 12) == (SOURCE, ())  # not the old answer's choice


def test_before_anything_is_answered_it_drafts_the_prediction_s_start() -> None:
    drafter = PredictionDrafter(PREDICTION)
    assert _next(drafter, drafter.begin(PROMPT), ()) == (SOURCE, PREDICTION[:2])


def test_it_follows_an_answer_given_one_token_a_round() -> None:
    drafter = PredictionDrafter(PREDICTION)
    state = drafter.begin(PROMPT)
    for n in range(1, 6):
        assert _next(drafter, state, PREDICTION[:n], k=1) == (SOURCE, PREDICTION[n:n + 1])


def test_an_answer_opening_with_other_text_joins_the_prediction_at_its_first_token() -> None:
    drafter = PredictionDrafter(PREDICTION)
    state = drafter.begin(PROMPT)
    assert _next(drafter, state, (5,)) == (SOURCE, ())
    assert _next(drafter, state, (5, 6, PREDICTION[0])) == (SOURCE, PREDICTION[1:3])


def test_a_round_drafts_at_most_thirty_two_tokens_past_an_agreeing_answer() -> None:
    prediction = tuple(range(100, 200))
    drafter = PredictionDrafter(prediction)
    state = drafter.begin(PROMPT)
    assert _next(drafter, state, prediction[:50], k=50)[1] == prediction[50:82]


def test_agreement_counts_no_further_back_than_the_prediction_s_start() -> None:
    """A prompt that ends with the prediction's last token does not lengthen the run the
    answer has agreed for."""
    prediction = (10, 11, 12, 13, 14, 15, 16, 17)
    drafter = PredictionDrafter(prediction)
    prompt = (1, 2, 17)
    state = drafter.begin(prompt)
    context = DraftContext((*prompt, 10, 11, 12), GREEDY, None)
    assert drafter.propose(state, context, 8).tokens == (13, 14, 15)


def test_a_prediction_shorter_than_the_longest_run_still_rejoins() -> None:
    drafter = PredictionDrafter((10, 11, 12, 13, 14, 15))
    state = drafter.begin(PROMPT)
    _next(drafter, state, (10,))
    assert _next(drafter, state, (10, 7, 8, 9, 11, 12, 13))[1] == (14, 15)


def test_a_run_that_recurs_rejoins_at_its_first_occurrence_after_the_last_match() -> None:
    run = (7, 8, 9)
    prediction = (*run, 10, 11, *run, 20, 21, *run, 30, 31, *run, 40, 41)
    drafter = PredictionDrafter(prediction)
    state = drafter.begin(PROMPT)
    _next(drafter, state, prediction[:5])
    assert _next(drafter, state, (*prediction[:5], 99, *run))[1] == (20, 21, 7)


def test_at_the_prediction_s_end_the_server_s_drafter_drafts() -> None:
    drafter = PredictionDrafter(PREDICTION, _Scripted(lambda answer: (7,)))
    state = drafter.begin(PROMPT)
    assert _next(drafter, state, PREDICTION) == ("model", (7,))


def test_a_one_token_round_drafts_the_prediction_s_next_token() -> None:
    drafter = PredictionDrafter(PREDICTION)
    state = drafter.begin(PROMPT)
    assert _next(drafter, state, PREDICTION[:6], k=1) == (SOURCE, PREDICTION[6:7])


def test_lookup_agreeing_with_the_prediction_is_no_dispute() -> None:
    """Lookup proposing what the prediction says, round after round, earns it nothing:
    at the first real dispute the prediction drafts."""
    def lookup(answer: tuple[int, ...]) -> tuple[int, ...]:
        return (999,) if len(answer) == 4 else PREDICTION[len(answer):len(answer) + 4]

    drafter = PredictionDrafter(PREDICTION, _Scripted(lookup, source="lookup"))
    state = drafter.begin(PROMPT)
    for n in range(1, 5):
        assert _next(drafter, state, PREDICTION[:n])[0] == SOURCE


@pytest.mark.parametrize(("winners", "drafts"), [
    ("p", SOURCE), ("l", "lookup"), ("lp", SOURCE), ("pl", "lookup"),
], ids=["prediction-won", "lookup-won", "lookup-then-prediction", "prediction-then-lookup"])
def test_the_latest_disputes_decide_who_drafts_the_next(winners: str, drafts: str) -> None:
    """Disputes (lookup says 999, the prediction its next token) that the answer settles
    one way then the other: the more recent winner drafts the next dispute."""
    prediction = tuple(range(100, 140))
    steps = [5 + 6 * i for i in range(len(winners) + 1)]  # a dispute at each of these
    answer: list[int] = list(prediction[:steps[0]])
    for step, winner in zip(steps, winners, strict=False):
        answer = [*answer[:step], prediction[step] if winner == "p" else 999]
        answer += list(prediction[step + 1:step + 6])  # back on the prediction after it
    at = steps[len(winners)]
    answer = answer[:at]

    def lookup(now: tuple[int, ...]) -> tuple[int, ...]:
        return (999,) if len(now) in steps else prediction[len(now):len(now) + 1]

    drafter = PredictionDrafter(prediction, _Scripted(lookup, source="lookup"))
    state = drafter.begin(PROMPT)
    for n in range(1, at):
        _next(drafter, state, answer[:n])
    assert _next(drafter, state, answer)[0] == drafts


def test_a_prediction_keeps_its_rounds_while_it_keeps_a_token_a_round() -> None:
    """Probes the answer keeps whole, then one it keeps one token of, then ones it
    leaves at once: the rounds go to the server's drafter once the decayed average of
    kept tokens falls below one, and not before."""
    prediction = tuple(range(100, 200))
    drafter = PredictionDrafter(prediction, _Scripted(lambda answer: (7,)))
    state = drafter.begin(PROMPT)
    answer: list[int] = []
    sources = []
    for n in range(8):  # followed a token a round: two probes kept whole
        sources.append(_next(drafter, state, prediction[:n])[0])
    answer = list(prediction[:8])
    at = 8
    for keep in (1, 0, 0, 0, 0, 0, 0):
        answer += [*prediction[at:at + keep], 99, *prediction[at + keep + 1:at + keep + 4]]
        at += keep + 4
        sources.append(_next(drafter, state, answer[:len(answer) - 3])[0])  # off it
        sources.append(_next(drafter, state, answer)[0])  # back on it
    # kept, decayed: 4, then 3.25 after the one-token probe, then 2.44, 1.83, 1.37, 1.03
    # and 0.77 after the misses: the fifth miss hands the rounds over
    assert sources == [SOURCE] * 8 + ["model", SOURCE] * 5 + ["model"] * 4, sources
    # exactly one token a round is enough
    state = drafter.begin(PROMPT)
    _next(drafter, state, prediction[:1])
    _next(drafter, state, (*prediction[:2], 99))
    assert _next(drafter, state, (*prediction[:2], 99, *prediction[3:6]))[0] == SOURCE


# -- the default model, through the engine ----------------------------------------------


@pytest.fixture(scope="module")
def served() -> CausalLM:
    """The default model as the server runs it: the GGUF's int4 weights on the native
    kernels, batch-invariant, so a verify pass gives each position the logits of a
    one-token step bitwise."""
    return load_target("default", "bfloat16", "cpu", "auto", "auto", True)


@pytest.fixture(scope="module")
def engine(served: CausalLM) -> Iterator[Engine]:
    engine = Engine(served, {"ngram": NgramDrafter()}, default_drafter="ngram",
                    predicted=PredictionDrafter.around)
    engine.start()
    yield engine
    engine.shutdown()


CODE = '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)
'''
QUESTION = ("Rename the variable total to running_sum in this Python function, and answer "
            f"with the whole function in a code block.\n\n```python\n{CODE}```")


def _events(engine: Engine, request: GenerationRequest) -> list[RoundEvent]:
    return list(engine.submit(request))


def _tokens(events: list[RoundEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _logprobs(events: list[RoundEvent]) -> list[TokenLogprob]:
    return [lp for e in events for lp in e.logprobs]


def _request(served: CausalLM, sampling: SamplingParams, prediction: str | None,
             **fields: object) -> GenerationRequest:
    ids = tuple(encode_chat(served.tokenizer, [{"role": "user", "content": QUESTION}]))
    predicted = tuple(encode_text(served.tokenizer, prediction)) if prediction else ()
    return GenerationRequest(prompt_ids=ids, max_new_tokens=96, sampling=sampling,
                             prediction=predicted, **fields)  # type: ignore[arg-type]


@pytest.mark.real_model
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.8, seed=11),
                                      SamplingParams(temperature=1.0, top_p=0.9, seed=3)],
                         ids=["greedy", "seeded", "seeded-top-p"])
def test_a_prediction_changes_no_token_and_no_logprob(
        engine: Engine, served: CausalLM, sampling: SamplingParams) -> None:
    """The answer with the original code, the answer itself, and unrelated text as the
    prediction: each the same tokens and log-probabilities (bitwise) as without one,
    with drafts from the prediction verified (and, from the answer, kept)."""
    fields = {"logprobs": True, "top_logprobs": 3}
    without = _events(engine, _request(served, sampling, None, **fields))
    answer = str(served.tokenizer.decode(_tokens(without), skip_special_tokens=True))
    for prediction in (CODE, answer, "SELECT name FROM users WHERE id = 1;\n" * 3):
        events = _events(engine, _request(served, sampling, prediction, **fields))
        assert _tokens(events) == _tokens(without), prediction
        assert _logprobs(events) == _logprobs(without), prediction
        predicted = [e for e in events if e.draft_source == SOURCE]
        if prediction is answer:
            assert sum(e.accepted_tokens for e in predicted) >= len(_tokens(without)) // 2
        if prediction is CODE:
            assert sum(e.draft_tokens for e in predicted) > 0


@pytest.mark.real_model
def test_several_choices_decoding_together_with_predictions(
        engine: Engine, served: CausalLM) -> None:
    """Two seeded choices decoding in one engine batch, each with its own answer's text
    as the prediction, give the tokens they give without one."""
    requests = [_request(served, SamplingParams(temperature=0.9, seed=5, choice=c), None)
                for c in range(2)]
    without = [_tokens(list(s)) for s in [engine.submit(r) for r in requests]]
    predicted = [
        _request(served, SamplingParams(temperature=0.9, seed=5, choice=c),
                 str(served.tokenizer.decode(without[c], skip_special_tokens=True)))
        for c in range(2)]
    assert [_tokens(list(s)) for s in [engine.submit(r) for r in predicted]] == without
