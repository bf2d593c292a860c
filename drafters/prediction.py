"""Predicted outputs: the client's own draft of the answer (OpenAI's ``prediction``).

An editor asking for a rewrite of a function already holds most of the answer: the
function. The prediction is tokenized once, and from the first round on this drafter
proposes its next tokens, where the answer so far follows it. When the answer leaves
it (a line inserted, one dropped, a name changed), it finds where the answer rejoins
it as a diff would: the answer's last tokens are looked up among the prediction's
n-grams, the longest first and never fewer than three, and of their occurrences the
first one after the last place the answer matched is taken (else the nearest before
it); before the answer has matched anything, its last tokens may also be the
prediction's first ones, however few (an answer that opens a code block and then
starts the code). Shorter runs (a newline and an indent, ``self.``) recur everywhere: replayed on
the tuning edits' answers, rejoining from runs of one or two tokens kept 7% more
drafted tokens but had 98 rounds whose first drafted token was rejected where runs of
three had 25, and such rounds teach the prediction's policy to draft less where it
does follow the answer; lookup covers those places from the prompt. Verification
keeps exactly what the target alone would write, so a prediction changes the speed,
never the text.

While the answer is away from the prediction, the server's drafter (lookup, the
continuation cache, a model) drafts; where both could, the prediction does. Rounds
drafted from the prediction name their source ``prediction``, so that it keeps its
own draft-length policy (how far it drafts follows the acceptance it measures in this
request against the target's verify curve) and its own figures in the metrics.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

from decoding.drafter import BaseDrafter, DraftContext, Drafter, DraftProposal

SOURCE = "prediction"  # the source a round drafted from the prediction names
# the most and the fewest trailing tokens of the answer looked up in the prediction
LONGEST_KEY = 8
SHORTEST_KEY = 3  # the fewest (shorter runs recur by chance: a newline and an indent)
# Each round the prediction follows the answer it says what the next PROBE tokens are,
# drafted or not, and is scored by how many the answer kept (decayed at RATE a round);
# below TRUSTED, the server's drafter drafts instead (a prediction unrelated to the
# answer hands the rounds back to lookup).
PROBE = 4
RATE = 0.25
TRUSTED = 1.0


@dataclass
class PredictionState:
    inner: object  # the server drafter's own state (None without one)
    prompt_length: int
    at: int | None = 0  # the prediction's next token for the answer; None: the answer left it
    matched: int = 0  # the prediction position right after the answer's last match
    followed: int = 0  # answer tokens compared with the prediction so far
    probe: tuple[int, ...] = ()  # what the prediction said would follow ``probe_from``
    probe_from: int = 0  # answer tokens when it was said
    kept: float | None = None  # its proposals' tokens the answer kept, on average (decayed)
    # index[n][ngram]: the positions right after each occurrence of an n-token run of the
    # prediction, in order
    index: dict[int, dict[tuple[int, ...], list[int]]] = field(default_factory=dict)


class PredictionDrafter(BaseDrafter[PredictionState]):
    """Drafts a request's answer from its prediction, and otherwise with ``inner`` (the
    drafter the request would use without one; None: nothing else drafts)."""

    def __init__(self, prediction: Sequence[int], inner: Drafter | None = None) -> None:
        if not prediction:
            raise ValueError("a prediction needs at least one token")
        self.prediction = tuple(prediction)
        self.inner = inner
        self.name = inner.name if inner is not None else SOURCE
        self.reads_features = inner.reads_features if inner is not None else False

    @classmethod
    def around(cls, prediction: Sequence[int], inner: Drafter | None) -> PredictionDrafter:
        """The drafter of a request with ``prediction`` whose own drafter is ``inner``."""
        return cls(prediction, inner)

    def begin(self, prompt_ids: Sequence[int]) -> PredictionState:
        inner = self.inner.begin(prompt_ids) if self.inner is not None else None
        return PredictionState(inner, len(prompt_ids), index=self._index())

    def warmup(self) -> None:
        if self.inner is not None:
            self.inner.warmup()

    def source(self, state: PredictionState, context: DraftContext) -> str:
        if self.inner is None or self._leads(state, context.token_ids) is not None:
            return SOURCE
        return self.inner.source(state.inner, context) or self.inner.name

    def propose(self, state: PredictionState, context: DraftContext, k: int) -> DraftProposal:
        at = self._leads(state, context.token_ids)
        if at is not None:
            return DraftProposal(self.prediction[at : at + k]) if k > 0 else DraftProposal.empty()
        if self.inner is None:
            return DraftProposal.empty()
        return self.inner.propose(state.inner, context, k)

    def _leads(self, state: PredictionState, committed: Sequence[int]) -> int | None:
        """Where the prediction drafts this round from, if it does: where the answer
        follows it, and its proposals have lately kept at least ``TRUSTED`` tokens (or
        nothing else drafts)."""
        at = self._follow(state, committed)
        trusted = self.inner is None or state.kept is None or state.kept >= TRUSTED
        return at if trusted else None

    def rollback(self, state: PredictionState, length: int) -> None:
        if length - state.prompt_length < state.followed:  # never in decoding: start over
            state.at, state.matched, state.followed, state.probe = 0, 0, 0, ()
        if self.inner is not None:
            self.inner.rollback(state.inner, length)

    def release(self, state: PredictionState) -> None:
        state.index.clear()
        if self.inner is not None:
            self.inner.release(state.inner)

    def _index(self) -> dict[int, dict[tuple[int, ...], list[int]]]:
        tokens = self.prediction
        index: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for n in range(SHORTEST_KEY, min(LONGEST_KEY, len(tokens)) + 1):
            table: dict[tuple[int, ...], list[int]] = {}
            for end in range(n, len(tokens) + 1):
                table.setdefault(tokens[end - n : end], []).append(end)
            index[n] = table
        return index

    def _follow(self, state: PredictionState, committed: Sequence[int]) -> int | None:
        """The prediction position the answer's next token would take, after comparing
        the tokens committed since the last call; None where the answer is off the
        prediction and has not rejoined it (or has reached its end)."""
        answer = len(committed) - state.prompt_length
        if state.followed == answer:
            return self._at(state)
        self._score(state, committed)
        prediction = self.prediction
        for token in committed[state.prompt_length + state.followed :]:
            at = state.at
            if at is not None and at < len(prediction) and prediction[at] == token:
                state.at = state.matched = at + 1
            else:
                state.at = None
        if state.at is None:
            state.at = self._rejoin(state, committed)
        state.followed = answer
        at = self._at(state)
        if at is not None and not state.probe:  # scored once the answer has gone past it
            state.probe, state.probe_from = prediction[at : at + PROBE], answer
        return at

    def _at(self, state: PredictionState) -> int | None:
        at = state.at
        return at if at is not None and at < len(self.prediction) else None

    def _score(self, state: PredictionState, committed: Sequence[int]) -> None:
        """Score the pending probe against the answer, once the answer decides it: how
        many of its tokens the answer kept."""
        start = state.prompt_length + state.probe_from
        after = committed[start : start + len(state.probe)]
        kept = 0
        while kept < len(after) and after[kept] == state.probe[kept]:
            kept += 1
        if state.probe and (kept < len(after) or kept == len(state.probe)):
            state.kept = kept if state.kept is None else (1 - RATE) * state.kept + RATE * kept
            state.probe = ()

    def _rejoin(self, state: PredictionState, committed: Sequence[int]) -> int | None:
        """Where the answer's last tokens occur in the prediction (the position after
        them): the longest run of at least SHORTEST_KEY that occurs, its first occurrence
        after the last match, else its nearest before it. Before any match, the answer's
        last tokens may also begin the prediction, however few (an answer opens a code
        block, then starts the code)."""
        longest = min(LONGEST_KEY, len(committed))
        if state.matched == 0:
            for n in range(longest, 0, -1):
                if tuple(committed[len(committed) - n :]) == self.prediction[:n]:
                    return n
        for n in range(longest, SHORTEST_KEY - 1, -1):
            found = state.index.get(n, {}).get(tuple(committed[len(committed) - n :]))
            if found:
                ahead = bisect_right(found, state.matched)
                return found[ahead] if ahead < len(found) else found[-1]
        return None
