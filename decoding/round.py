"""The speculative round: draft -> one target pass -> verify -> commit -> the event.

``speculative_round`` is the whole of speculation, for one sequence (``decode``) or for
every running sequence of the engine at once. The engine only decides what goes into
the pass (which prompt chunks, how many tokens each sequence drafts); the round does
the rest, and hands back each sequence's event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import ParamSpec, TypeVar

import torch

from decoding.drafter import Drafter, DraftProposal
from decoding.drafting import Draft
from decoding.invariance import InvarianceCheck
from decoding.policy import AdaptiveSpeculation
from decoding.prefix_cache import PrefixCache
from decoding.sequence import SequenceDecoder
from decoding.target import StateT, Target
from decoding.types import (
    GenerationRequest,
    PromptChunk,
    RoundEvent,
    RoundTiming,
    SamplingParams,
)
from decoding.verify import verify
from runtime.runner.passes import BatchItem, PreparedPass

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")
S = TypeVar("S")  # any runner's per-sequence state


@dataclass(frozen=True)
class Outcome:
    """What a round did to one sequence: its event (None after a prompt chunk that is
    not the prompt's last) and the draft it verified (None for a prompt chunk)."""

    sequence: SequenceDecoder
    event: RoundEvent | None
    draft: Draft | None = None


@dataclass(frozen=True)
class RoundResult:
    outcomes: list[Outcome]  # prompt chunks first, then the decoding sequences, as given
    passes: int  # target passes run (more than one only when a batched pass failed)
    pass_tokens: int  # tokens in the pass
    pass_s: float  # its seconds (0 when the batched pass failed)


def speculative_round(target: Target[StateT],
                      prompts: Sequence[tuple[SequenceDecoder[StateT], int]],
                      decoding: Sequence[tuple[SequenceDecoder[StateT], int]],
                      check: InvarianceCheck | None = None,
                      starting: Callable[[], None] | None = None) -> RoundResult:
    """One iteration: the next chunk (at most the given tokens) of each prompt in
    ``prompts``, and for each sequence in ``decoding`` one speculative round drafting
    the given number of tokens, all in one target pass. A failure ends only the
    sequence at fault (its outcome is an error event). ``check``: the run-time
    invariance check, on a sample of the sequences' rounds. ``starting``: called once
    the target pass is prepared, right before its long call (the engine hands the
    previous round's events over there)."""
    outcomes: list[Outcome] = []
    work: list[tuple[SequenceDecoder[StateT], PromptChunk | Draft]] = []
    for seq, limit in prompts:
        chunk = _attempt(seq, outcomes, seq.next_prompt_chunk, limit)
        if chunk is not None:
            work.append((seq, chunk))
    for (seq, _), draft in zip(decoding, propose_drafts(decoding, outcomes), strict=True):
        if draft is not None:                                             # 1. drafted
            work.append((seq, draft))
    logits, features, passes, tokens, seconds = target_pass(target, work, starting)  # 2.
    for (seq, part), out, feats in zip(work, logits, features, strict=True):
        if out is None:
            outcomes.append(Outcome(seq, seq.failed("the model failed")))
            continue
        try:
            if isinstance(part, PromptChunk):
                event = seq.prompt_done(part, out, seconds, feats)
            else:
                event = verify_and_commit(seq, part, out, seconds, feats)  # 3, 4, 5
                if check is not None and tokens > 1 and check.sample():
                    _check_invariance(check, target, seq, part, event, out)
        except Exception:
            log.exception("model error in request %s", seq.request.request_id)
            outcomes.append(Outcome(seq, seq.failed("the model failed")))
            continue
        if event is not None and len(work) > 1:
            event = replace(event, batch_size=len(work))
        outcomes.append(Outcome(seq, event, part if isinstance(part, Draft) else None))
    return RoundResult(outcomes, passes, tokens, seconds)


def verify_and_commit(seq: SequenceDecoder, draft: Draft,
                      logits: torch.Tensor,  # [n_pass, vocab]: pending, drafts, alternative
                      forward_s: float,
                      features: torch.Tensor | None = None,  # [n_pass, H]
                      ) -> RoundEvent:
    """Verify a sequence's draft against the target's logits, roll its caches back to
    what was kept, and commit the kept tokens (3, 4 and 5 of the round)."""
    start = time.perf_counter()
    k = len(draft.tokens)
    scores = seq.process(logits[: k + 1], draft.tokens)  # [k + 1, vocab]
    verdict = verify(draft.tokens, draft.probs, scores, seq.generator, len(seq.committed.tokens),
                     alternative=draft.alternative,  # greedy, unpenalised: its row as given
                     after_alternative=logits[-1] if draft.alternative is not None else None,
                     cut_probs=draft.constrained.cut_row if draft.constrained else None,
                     first_largest=seq.target.first_largest)
    seq.roll_back(verdict, len(draft.tokens) + 1 + (draft.alternative is not None), features)
    timing = RoundTiming(draft.seconds, forward_s + time.perf_counter() - start, 0.0)
    draft.learn(verdict, timing)
    behind = (torch.stack([logits[0], logits[-1]]) if verdict.alternative_taken
              else logits)  # the logits each committed token came from
    drafted = k + (draft.alternative is not None)
    accepted = 1 if verdict.alternative_taken else verdict.accepted
    event = seq.commit(verdict.committed(draft.tokens), drafted, accepted, behind, timing,
                       draft.started)
    forced = draft.constrained.forced if draft.constrained is not None else 0
    event = seq.grammar.annotate(event, min(forced, verdict.accepted))
    return event


def _check_invariance(check: InvarianceCheck, target: Target[StateT],
                      seq: SequenceDecoder[StateT],
                      draft: Draft, event: RoundEvent, logits: torch.Tensor) -> None:
    """The pass's logits at the last position the round cached (those that chose the
    next token) against a one-token step's; rounds that end the sequence or took an
    alternative (whose cache was moved) are not checked."""
    state = seq.state
    if (event.finished or draft.alternative is not None or state is None
            or state.length != len(seq.committed.tokens) - 1 or not event.token_ids):
        return
    check.check(target, state, seq.committed.tokens[-2], logits[len(event.token_ids) - 1],
                seq.request.request_id)


def propose_drafts(decoding: Sequence[tuple[SequenceDecoder, int]], outcomes: list[Outcome]
                   ) -> list[Draft | None]:
    """Each sequence's draft of the given length: made together with the others that share
    its drafter where it can (a draft model's steps run batched), each with its share of
    the seconds. A sequence whose drafting fails ends with an error (None here)."""
    for seq, _ in decoding:  # a prompt whose first token went out last round is stored now
        seq.store_prompt()
    made: list[tuple[DraftProposal, float] | None] = [None] * len(decoding)
    groups: dict[int, list[int]] = {}
    for i, (seq, k) in enumerate(decoding):
        if k > 0 and seq.drafting is not None:
            groups.setdefault(id(seq.drafting.drafter), []).append(i)
    for members in (m for m in groups.values() if len(m) > 1):
        seqs = [decoding[i][0] for i in members]
        ks = [decoding[i][1] for i in members]
        start = time.perf_counter()
        try:
            drafting = [s.drafting for s in seqs if s.drafting is not None]  # all (grouped so)
            proposals = drafting[0].drafter.propose_many([d.drafter_state for d in drafting],
                                                         [s.draft_context() for s in seqs], ks)
        except Exception:
            log.warning("drafting for %d requests together failed; each drafts alone",
                        len(members), exc_info=True)
            continue
        seconds = time.perf_counter() - start
        for i, proposal, k in zip(members, proposals, ks, strict=True):
            made[i] = (proposal, seconds * k / sum(ks))
    return [_attempt(seq, outcomes, seq.propose, k, made[i])
            for i, (seq, k) in enumerate(decoding)]


Features = list[torch.Tensor | None]  # per sequence: its tokens' final hidden states


def target_pass(target: Target[StateT],
                work: Sequence[tuple[SequenceDecoder[StateT], PromptChunk | Draft]],
                starting: Callable[[], None] | None = None,
                ) -> tuple[list[torch.Tensor | None], Features, int, int, float]:
    """The kept logits of every sequence's tokens from one forward pass, and their final
    hidden states where a sequence asked for them; the passes run, the tokens in the
    pass and its seconds (``starting``: called between the pass's preparation and its
    run). When the pass fails each sequence runs alone, so only the one at fault fails
    (None, its caches as they were)."""
    items = [seq.pass_item(part) for seq, part in work]
    tokens = sum(len(item.token_ids) for item in items)
    if not items:
        return [], [], 0, 0, 0.0
    start = time.perf_counter()
    try:
        logits, features = _run(target, items, starting)
        return list(logits), features, 1, tokens, time.perf_counter() - start
    except Exception:
        log.log(logging.WARNING if len(items) > 1 else logging.ERROR,
                "a forward pass of %d sequences failed", len(items), exc_info=True)
        for seq, part in work:
            seq.undo(part)
        if len(items) == 1:
            return [None], [None], 0, tokens, 0.0
    outputs: list[torch.Tensor | None] = []
    features = []
    for (seq, part), item in zip(work, items, strict=True):  # each alone
        try:
            alone, feats = _run(target, [item])
            outputs.append(alone[0])
            features.append(feats[0])
        except Exception:
            log.exception("the forward pass failed in request %s", seq.request.request_id)
            seq.undo(part)
            outputs.append(None)
            features.append(None)
    return outputs, features, sum(out is not None for out in outputs), tokens, 0.0


def _run(target: Target[StateT], items: Sequence[BatchItem[StateT]],
         starting: Callable[[], None] | None = None) -> tuple[list[torch.Tensor], Features]:
    prepared = target.prepare_pass(items)
    if starting is not None:
        starting()
    logits = target.run_pass(prepared)
    return logits, with_layers(prepared) or [None] * len(items)


def with_layers(prepared: PreparedPass[S]) -> Features:
    """Each item's final hidden states, and where the target captures layers (for a
    feature draft that fuses them) those layers' outputs after them: [n, H + L*H]."""
    if not prepared.layers:
        return list(prepared.features)
    return [f if f is None or layers is None else torch.cat([f, layers], dim=1)
            for f, layers in zip(prepared.features, prepared.layers, strict=True)]


def _attempt(seq: SequenceDecoder, outcomes: list[Outcome], make: Callable[P, T],
             *args: P.args, **kwargs: P.kwargs) -> T | None:
    """``make(*args)``, or None after ending ``seq`` with an error when it raises."""
    try:
        return make(*args, **kwargs)
    except Exception:
        log.exception("drafting failed in request %s", seq.request.request_id)
        outcomes.append(Outcome(seq, seq.failed("the model failed")))
        return None


def step(decoder: SequenceDecoder[StateT]) -> RoundEvent:
    """Run one round of ``decoder`` alone and describe what it committed (the whole
    prompt's prefill is one round here; an engine feeds a long prompt in chunks)."""
    while True:
        if decoder.rounds == 0:
            outcome = speculative_round(decoder.target, [(decoder, 0)], []).outcomes[0]
        else:
            outcome = speculative_round(decoder.target, [],
                                        [(decoder, decoder.draft_length())]).outcomes[0]
        if outcome.event is not None:
            return outcome.event


def decode(
    target: Target[StateT],
    drafter: Drafter | None,
    request: GenerationRequest,
    policy: AdaptiveSpeculation | None = None,
    prefix_cache: PrefixCache | None = None,
) -> Iterator[RoundEvent]:
    """Run one request to the end in the calling thread, yielding each round."""
    decoder = SequenceDecoder(target, drafter, request, policy, prefix_cache)
    try:
        while not decoder.finished:
            yield step(decoder)
    finally:
        decoder.close()


def warm_up(target: Target, drafters: Sequence[Drafter]) -> None:
    """Prepare the target's and the draft models' kernels for every small pass size,
    then run one short request through every drafter (and none), in this thread."""
    target.warmup()
    for drafter in drafters:
        drafter.warmup()
    ids = tuple(target.tokenizer.encode("Hello, world. Hello, world.")) or (0,)
    for chosen in [None, *drafters]:
        request = GenerationRequest(prompt_ids=ids, max_new_tokens=4,
                                    sampling=SamplingParams(temperature=0.0))
        for _ in decode(target, chosen, request):
            pass
