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
continuation cache, a model) drafts. Where both could, the prediction does, unless
lookup proposes another next token and has lately been the one right where the two
differed (after a rename lookup has the new name from the answer itself), or the
prediction's own guesses have lately kept less than a token a round (a prediction
unrelated to the answer). A round drafts no further ahead than the answer has agreed
with the prediction behind, as lookup's do. Rounds drafted from the prediction name
their source ``prediction``, so that it keeps its own draft-length policy (how far it
drafts follows the acceptance it measures in this request against the target's verify
curve) and its own figures in the metrics.
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

from decoding.drafter import BaseDrafter, DraftContext, Drafter, DraftProposal
from decoding.policy import MAX_DRAFT_TOKENS

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
# The sources of the server's drafters that cost nothing to ask (n-gram lookup and the
# continuation cache, alone or as a combined drafter's "lookup"): where the prediction
# would draft, such a source is asked for its first token too, and where the two differ
# the one that has lately been right in such disputes drafts (the prediction at first).
# Lookup reads the answer's own text, so after a rename it knows the new name the
# prediction does not.
# A round drafts no further ahead than the answer has agreed with the prediction behind
# (up to AGREEMENT tokens back), and at least SHORTEST_RUN tokens, as lookup does: a run
# that has agreed for 20 tokens is likely to go on, one just rejoined is as likely to part.
AGREEMENT = 32
SHORTEST_RUN = 2
CHEAP_SOURCES = frozenset({"lookup", "ngram", "cache"})


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
    # this round's choice: the answer's length it was made at, and the prediction position
    # it drafts from (None: the server's drafter drafts)
    chosen_at: int = -1
    choice: int | None = None
    dispute: tuple[int, int, int] | None = None  # (answer position, the prediction's token,
    # lookup's) where they differed, until the answer decides it
    lookup_right: float = 0.0  # who won the disputes, decayed: > 0 lookup, < 0 the prediction
    # index[n][ngram]: the positions right after each occurrence of an n-token run of the
    # prediction, in order
    index: dict[int, dict[tuple[int, ...], list[int]]] = field(default_factory=dict)  # _runs


Runs = dict[int, dict[tuple[int, ...], list[int]]]


@functools.lru_cache(maxsize=4)  # a few requests' at once (8k tokens: about 10 MB)
def _runs(prediction: tuple[int, ...]) -> Runs:
    """Where each run of SHORTEST_KEY .. LONGEST_KEY tokens of ``prediction`` ends
    (the positions right after its occurrences, in order); made once for all the choices
    of a request, and only read."""
    runs: Runs = {}
    for n in range(SHORTEST_KEY, min(LONGEST_KEY, len(prediction)) + 1):
        table: dict[tuple[int, ...], list[int]] = {}
        for end in range(n, len(prediction) + 1):
            table.setdefault(prediction[end - n : end], []).append(end)
        runs[n] = table
    return runs


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
        return PredictionState(inner, len(prompt_ids), index=_runs(self.prediction))

    def warmup(self) -> None:
        if self.inner is not None:
            self.inner.warmup()

    def source(self, state: PredictionState, context: DraftContext) -> str:
        if self.inner is None or self._leads(state, context) is not None:
            return SOURCE
        return self.inner.source(state.inner, context) or self.inner.name

    def propose(self, state: PredictionState, context: DraftContext, k: int) -> DraftProposal:
        at = self._leads(state, context)
        if at is not None:
            run = min(k, max(self._agreement(context.token_ids, at), SHORTEST_RUN))
            return DraftProposal(self.prediction[at : at + run]) if k > 0 else DraftProposal.empty()
        if self.inner is None:
            return DraftProposal.empty()
        return self.inner.propose(state.inner, context, k)

    def _leads(self, state: PredictionState, context: DraftContext) -> int | None:
        """Where the prediction drafts this round from, if it does (decided once a round):
        where the answer follows it, its proposals have lately kept at least ``TRUSTED``
        tokens (or nothing else drafts), and lookup does not disagree having lately been
        right where they disagreed."""
        committed = context.token_ids
        answer = len(committed) - state.prompt_length
        if state.chosen_at == answer:
            return state.choice
        at = self._follow(state, committed)
        if at is not None and self.inner is not None and state.kept is not None and (
                state.kept < TRUSTED):
            at = None
        if at is not None and self.inner is not None:
            theirs = self._cheap_first(state, context)
            if theirs is not None and theirs != self.prediction[at]:
                state.dispute = (answer, self.prediction[at], theirs)
                if state.lookup_right > 0:
                    at = None
        state.chosen_at, state.choice = answer, at
        return at

    def _cheap_first(self, state: PredictionState, context: DraftContext) -> int | None:
        """The first token the server's drafter would draft, where asking costs nothing."""
        assert self.inner is not None
        source = self.inner.source(state.inner, context) or self.inner.name
        if source not in CHEAP_SOURCES:
            return None
        # asked for as much as a round may take, as when it drafts: a combined drafter
        # scores what it proposes against the answer, and a cut proposal would look short
        tokens = self.inner.propose(state.inner, context, MAX_DRAFT_TOKENS).tokens
        return tokens[0] if tokens else None

    def rollback(self, state: PredictionState, length: int) -> None:
        if length - state.prompt_length < state.followed:  # never in decoding: start over
            state.at, state.matched, state.followed, state.probe = 0, 0, 0, ()
            state.chosen_at, state.dispute = -1, None
        if self.inner is not None:
            self.inner.rollback(state.inner, length)

    def release(self, state: PredictionState) -> None:
        state.index = {}  # shared by the choices of a request: dropped, not cleared
        if self.inner is not None:
            self.inner.release(state.inner)

    def _follow(self, state: PredictionState, committed: Sequence[int]) -> int | None:
        """The prediction position the answer's next token would take, after comparing
        the tokens committed since the last call; None where the answer is off the
        prediction and has not rejoined it (or has reached its end)."""
        answer = len(committed) - state.prompt_length
        if state.followed == answer:
            return self._at(state)
        self._score(state, committed)
        self._settle(state, committed)
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

    def _agreement(self, committed: Sequence[int], at: int) -> int:
        """How many of the answer's last tokens the prediction has right before ``at``
        (up to AGREEMENT)."""
        agree = 0
        while (agree < min(at, AGREEMENT, len(committed))
               and committed[len(committed) - 1 - agree] == self.prediction[at - 1 - agree]):
            agree += 1
        return agree

    def _at(self, state: PredictionState) -> int | None:
        at = state.at
        return at if at is not None and at < len(self.prediction) else None

    def _settle(self, state: PredictionState, committed: Sequence[int]) -> None:
        """Settle the pending dispute, once the answer has its token."""
        if state.dispute is None:
            return
        position, ours, theirs = state.dispute
        if state.prompt_length + position >= len(committed):
            return
        token = committed[state.prompt_length + position]
        if token in (ours, theirs):
            won = 1.0 if token == theirs else -1.0
            state.lookup_right = (1 - RATE) * state.lookup_right + RATE * won
        state.dispute = None

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
