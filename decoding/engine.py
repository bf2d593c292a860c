"""The engine: one model thread serving many requests, round by round.

Requests wait in a bounded queue; the scheduler (``decoding.scheduler``) decides which
join, up to ``max_active`` while the KV blocks for their prompts are free, and each
stream's draft length, chosen for the batch as a whole. When a pass would need more KV
blocks than are free, the newest running requests are preempted: their blocks go back,
and they rejoin first once there is room, their KV computed again from the tokens they
had (their clients see a pause, never a changed token). Every iteration runs one forward
pass holding the next chunk of waiting prompts (at most ``prefill_chunk`` tokens, so a long
prompt does not stall running streams) and one speculation round for every running stream.
Requests join and leave at round boundaries. A round's events reach their streams once the
next pass is prepared, before its long native call (``decoding.handoff``), or once the
engine has nothing more to run. A cancelled request (client gone) is dropped before its
next round and its KV caches are freed; a request past its deadline (on the engine's
``clock``) ends with ``timeout``; a model error ends only the
request that hit it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from decoding.drafter import Drafter
from decoding.handoff import Outbox
from decoding.invariance import InvarianceCheck
from decoding.kv_budget import KvBudget
from decoding.policy.cost import VerifyCurve
from decoding.policy.curve import SpeculationProfile, draft_cost
from decoding.policy.curve import describe as describe_curve
from decoding.policy.curve import measure as measure_curve
from decoding.prefix_cache import PrefixCache
from decoding.round import RoundResult, speculative_round, warm_up
from decoding.scheduler import RunningStream, Scheduler
from decoding.sequence import ContextOverflowError, SequenceDecoder
from decoding.streams import (
    END,
    EngineClosedError,
    QueueFullError,
    RequestStream,
    UnknownDrafterError,
)
from decoding.target import Target
from decoding.threads import cpu_threads
from decoding.types import FinishReason, GenerationRequest, RoundEvent

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_ACTIVE = 16
DEFAULT_PREFILL_CHUNK = 512  # prompt tokens per iteration, so long prompts do not stall streams


@dataclass
class _Active:
    stream: RequestStream
    decoder: SequenceDecoder
    deadline: float | None


def _running(active: _Active) -> RunningStream:
    """What the batch plan reads of a running request about to draft."""
    own = active.decoder.drafting  # its drafter's state, if it drafts
    return RunningStream(active.stream.drafter, own.source if own is not None else "",
                         own.policy if own is not None else None,
                         active.decoder.committed.remaining - 1)


class Engine:
    def __init__(
        self,
        target: Target,
        drafters: Mapping[str, Drafter] | None = None,
        default_drafter: str | None = None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_active: int = DEFAULT_MAX_ACTIVE,
        prefix_cache: PrefixCache | None = None,
        info: Mapping[str, str] | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        batch_planning: bool = True,
        max_kv_bytes: int | None = None,
        decode_threads: int | None = None,
        invariance_check: InvarianceCheck | None = None,
        clock: Callable[[], float] = time.monotonic,
        predicted: Callable[[Sequence[int], Drafter | None], Drafter] | None = None,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        self.target = target
        self.prefill_chunk = prefill_chunk
        # which requests join, and each stream's draft length (batch_planning: chosen
        # for the whole batch); admission stops while the KV blocks for one more request's
        # prompt are not free in the pool of max_kv_bytes
        target.set_kv_budget(max_kv_bytes)
        self.scheduler = Scheduler(KvBudget(target, max_kv_bytes), max_active, batch_planning,
                                   target.capabilities.batched, clock)
        self.decode_threads = decode_threads  # CPU threads of a pass without prompts
        self.invariance_check = invariance_check  # decoding.invariance (debugging; None: off)
        self.clock = clock  # what request deadlines and queue times are measured by
        self.forward_passes = 0
        self.prefix_cache = prefix_cache
        self.info = dict(info or {})  # descriptive facts for clients (e.g. the draft backend)
        # the measured verify curve and the ceilings it promises (measure_verify_curve)
        self.speculation_profile: SpeculationProfile | None = None
        self.drafters = dict(drafters or {})
        if default_drafter is not None and default_drafter not in self.drafters:
            raise UnknownDrafterError(f"default drafter {default_drafter!r} is not loaded")
        self.default_drafter = default_drafter
        self.predicted = predicted  # a request's drafter from its prediction and own drafter
        self.max_queue = max_queue
        self._waiting: deque[RequestStream] = deque()
        self._active: list[_Active] = []
        self._preempted: deque[_Active] = deque()  # the oldest first: they rejoin first
        self.preemptions = 0  # requests preempted so far
        self._lock = threading.Condition()
        self._accepting = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._outbox = Outbox()

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specserve-model", daemon=True)
            self._thread.start()

    def stop_admitting(self) -> None:
        with self._lock:
            self._accepting = False

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Refuse new work, let in-flight requests finish for up to ``drain_timeout``
        seconds, cancel the rest, and stop the model thread."""
        self.stop_admitting()
        deadline = time.monotonic() + drain_timeout
        while self.num_running + self.num_waiting and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._lock:
            for stream in self._waiting:
                stream.cancel()
            for active in [*self._active, *self._preempted]:
                active.stream.cancel()
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.target.set_kv_budget(None)  # the budget held while this engine ran it

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def num_running(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        """Requests queued, and those preempted waiting to go on."""
        return len(self._waiting) + len(self._preempted)

    def kv_counts(self) -> dict[str, int]:
        """The target's KV blocks, as plain counts: ``used`` (held by a request), ``free``
        (where the pool is bounded), ``shared`` (held by more than one), ``block_bytes``,
        and the ``preemptions`` so far."""
        usage = self.target.kv_usage()
        counts = {"used": usage.used, "shared": usage.shared,
                  "block_bytes": self.target.kv_block_bytes, "preemptions": self.preemptions}
        if usage.limit is not None:
            counts["free"] = usage.limit - usage.used
        return counts

    # -- requests ------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; raises when it cannot be admitted."""
        if len(request.prompt_ids) >= self.target.max_context:
            raise ContextOverflowError(
                f"the prompt has {len(request.prompt_ids)} tokens; "
                f"the model's context is {self.target.max_context}"
            )
        budget = self.scheduler.kv_budget
        if budget.limit is not None and budget.to_start(len(request.prompt_ids)) > budget.limit:
            raise ContextOverflowError(
                f"the prompt has {len(request.prompt_ids)} tokens; the KV cache holds "
                f"{budget.positions()} positions in all (--kv-cache-bytes)")
        drafter = self._drafter_name(request)
        stream = RequestStream(request=request, drafter=drafter, submitted_at=self.clock())
        with self._lock:
            if not self._accepting:
                raise EngineClosedError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"the queue is full ({self.max_queue} waiting)")
            self._waiting.append(stream)
            self._lock.notify_all()
        return stream

    def warmup(self) -> None:
        """Prepare the target and the drafters (``round.warm_up``), outside the thread."""
        warm_up(self.target, list(self.drafters.values()))

    def measure_verify_curve(self, drafts: Mapping[str, Target[Any]] | None = None,
                             stored: tuple[VerifyCurve, Mapping[str, float]] | None = None
                             ) -> tuple[VerifyCurve, dict[str, float]]:
        """Measure what verifying k draft tokens costs the target, and a step of each
        draft model in ``drafts`` (by drafter name) in target steps (``decoding.policy.
        curve``), or take both from ``stored`` (an earlier measurement's), before the model
        thread starts: every draft-length policy prices rounds by the curve from then on, and
        ``speculation_profile`` shows it with the ceiling each drafter can reach."""
        if self._thread is not None:
            raise RuntimeError("the verify curve is measured before the engine starts")
        curve = stored[0] if stored else measure_curve(self.target)
        costs = dict(stored[1]) if stored else {
            name: draft_cost(draft, curve) for name, draft in (drafts or {}).items()}
        self.scheduler.verify_curve = curve
        self.scheduler.draft_costs.update(costs)
        self.speculation_profile = describe_curve(curve, {"lookup": 0.0, **costs})
        return curve, costs

    def _drafter_name(self, request: GenerationRequest) -> str | None:
        spec = request.speculation
        if not spec.enabled or spec.drafter == "none":
            return None
        name = spec.drafter or self.default_drafter
        if name is not None and name not in self.drafters:
            raise UnknownDrafterError(
                f"drafter {name!r} is not loaded; available: {sorted(self.drafters) or ['none']}")
        return name

    # -- the model thread ----------------------------------------------------------

    def _idle(self) -> bool:
        return (not self._stopping and not self._waiting and not self._active
                and not self._preempted)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._idle():  # nothing more to run: no pass will hand over what waits
                    self._outbox.hand_over()
                while self._idle():
                    self._lock.wait()
                if self._stopping:
                    break
                self._expire_waiting()
                self._admit()
                batch = list(self._active)
            try:
                self._iteration(batch)
            except Exception:  # a fault outside any one request's work: end the batch's
                log.exception("a decoding iteration failed; its requests end with an error")
                self._fail_batch(batch)
        self._drain_all()
        self._outbox.hand_over()

    def _fail_batch(self, batch: list[_Active]) -> None:
        """End every request of ``batch`` still running, with an error (the engine goes
        on with the next requests)."""
        with self._lock:
            running = [active for active in batch if active in self._active]
        for active in running:
            try:
                self._finish(active, active.decoder.failed("the model failed"))
            except Exception:
                log.exception("could not end request %s", active.stream.request.request_id)

    def _iteration(self, batch: list[_Active]) -> None:
        """What goes into the next pass: the next chunk of waiting prompts (within
        ``prefill_chunk`` tokens) and a round for every running stream, with its draft
        length; then the round, and its events handed out."""
        live = [active for active in batch if self._still_running(active)]
        prompts: list[tuple[SequenceDecoder, int]] = []
        budget = self.prefill_chunk
        for active in (a for a in live if a.decoder.prefilling):
            if budget <= 0:
                break
            prompts.append((active.decoder, budget))
            budget -= active.decoder.prefill_left
        decoding = [a for a in live if not a.decoder.prefilling and self._choose_source(a)]
        lengths = self._draft_lengths(decoding)
        prompts, decoding, lengths = self._make_room(prompts, decoding, lengths)
        by_decoder = {id(a.decoder): a for a in live}
        if not self.target.capabilities.batched:  # one sequence per forward pass: take turns
            self._outbox.hand_over()
            for decoder, limit in prompts:
                self._deliver(by_decoder, speculative_round(self.target, [(decoder, limit)], []))
            for active, k in zip(decoding, lengths, strict=True):
                self._deliver(by_decoder, speculative_round(self.target, [], [(active.decoder, k)]))
            return
        try:
            with cpu_threads(None if prompts else self.decode_threads):  # decoding.threads
                result = speculative_round(self.target, prompts, [
                    (a.decoder, k) for a, k in zip(decoding, lengths, strict=True)],
                    self.invariance_check, starting=self._outbox.hand_over)  # decoding.handoff
        finally:
            self._outbox.hand_over()  # whatever the round did not hand over
        if result.passes == 1 and not prompts:  # the step-cost fit describes decoding passes
            self.scheduler.step_cost.observe(result.pass_tokens, result.pass_s)
        self._deliver(by_decoder, result)

    def _deliver(self, by_decoder: dict[int, _Active], result: RoundResult) -> None:
        """Hand each sequence's event to its stream; end the finished ones."""
        self.forward_passes += result.passes
        for outcome in result.outcomes:
            active = by_decoder[id(outcome.sequence)]
            event = outcome.event
            if event is None:
                continue
            draft, drafting = outcome.draft, active.decoder.drafting
            if draft is not None and draft.expected is not None and drafting is not None:
                self.scheduler.drafted(active.stream.drafter, drafting.source,
                                       draft.expected, event.accepted_tokens)
            if event.finished:
                self._finish(active, event)
            else:
                self._outbox.send(active.stream, event)

    def _still_running(self, active: _Active) -> bool:
        stream = active.stream
        if stream.cancelled:
            self._finish(active, None)
            return False
        if active.deadline is not None and self.clock() > active.deadline:
            self._finish(active, active.decoder.final_event(FinishReason.TIMEOUT))
            return False
        if stream.started_at is None:
            stream.started_at = self.clock()
        return True

    def _choose_source(self, active: _Active) -> bool:
        """Which source drafts the request's next round; False when the drafter failed
        (the request ends, the others go on)."""
        try:
            active.decoder.choose_source()
            return True
        except Exception:
            log.exception("drafting failed in request %s", active.stream.request.request_id)
            self._finish(active, active.decoder.failed("the model failed"))
            return False

    def _draft_lengths(self, decoding: list[_Active]) -> list[int]:
        """Per sequence: the draft length the scheduler plans, or its own policy's."""
        plan = self.scheduler.plan([_running(a) for a in decoding])
        return [a.decoder.draft_length(k) for a, k in zip(decoding, plan, strict=True)]

    def _expire_waiting(self) -> None:
        """A request whose deadline passes while it waits ends with ``timeout``."""
        for stream in self.scheduler.expired(self._waiting):
            self._waiting.remove(stream)
            self._end(stream, FinishReason.TIMEOUT)

    def _free_blocks(self) -> int | None:
        """The KV blocks free for new requests: those no request holds, less those the
        requests still reading their prompts will take (None: no bound)."""
        free = self.scheduler.kv_budget.free()
        if free is None:
            return None
        for active in self._active:
            decoder = active.decoder
            if decoder.prefilling and decoder.state is not None:
                state = decoder.state
                free -= self.target.kv_needed(state, state.length + decoder.prefill_left)
        return free

    def _resume(self) -> None:
        """Preempted requests rejoin, the oldest first, while the blocks for what they
        had are free (with none running, the oldest rejoins all the same)."""
        budget = self.scheduler.kv_budget
        while self._preempted and len(self._active) < self.scheduler.max_active:
            active = self._preempted[0]
            if active.stream.cancelled or (active.deadline is not None
                                           and self.clock() > active.deadline):
                self._preempted.popleft()
                self._finish(active, None if active.stream.cancelled
                             else active.decoder.final_event(FinishReason.TIMEOUT))
                continue
            free = self._free_blocks()
            if (self._active and free is not None
                    and budget.to_start(active.decoder.held_positions) > free):
                return
            self._active.append(self._preempted.popleft())

    def _preempt(self, victim: _Active) -> None:
        """Give ``victim``'s KV blocks back; it rejoins first once they are free again."""
        log.info("request %s preempted: the KV cache is full",
                 victim.stream.request.request_id)
        victim.decoder.suspend()
        self.preemptions += 1
        with self._lock:
            self._active.remove(victim)
            index = sum(1 for p in self._preempted if p.stream.submitted_at
                        <= victim.stream.submitted_at)
            self._preempted.insert(index, victim)

    def _make_room(self, prompts: list[tuple[SequenceDecoder, int]], decoding: list[_Active],
                   lengths: list[int]
                   ) -> tuple[list[tuple[SequenceDecoder, int]], list[_Active], list[int]]:
        """The pass's work, once its sequences' KV blocks fit among the free ones: the
        newest running requests are preempted until they do (vLLM's recompute
        preemption), whether or not they are in this pass (a prompt waiting for its next
        chunk holds blocks too). A request alone that the pool cannot hold drafts nothing,
        and then ends with ``length``: its KV budget is spent."""
        budget = self.scheduler.kv_budget
        if budget.limit is None:
            return prompts, decoding, lengths
        target = self.target

        def needed() -> int:
            blocks = 0
            for decoder, limit in prompts:  # (a prompt's first chunk may load a cached prefix)
                state = decoder.live_state
                fresh = state.length == 0 and decoder.prompt.prefilled == 0
                chunk = decoder.prefill_left if fresh else min(limit, decoder.prefill_left)
                blocks += target.kv_needed(state, state.length + chunk)
            for active, k in zip(decoding, lengths, strict=True):
                state = active.decoder.live_state
                blocks += target.kv_needed(state, state.length + active.decoder.pass_tokens(k))
            return blocks

        while needed() > (budget.free() or 0):
            if len(self._active) > 1:
                victim = self._active[-1]  # the newest
                self._preempt(victim)
                prompts = [(d, n) for d, n in prompts if d is not victim.decoder]
                kept = [i for i, a in enumerate(decoding) if a is not victim]
                decoding, lengths = [decoding[i] for i in kept], [lengths[i] for i in kept]
            elif any(lengths):
                lengths = [0] * len(lengths)
            else:  # (a prompt alone always fits: submit refuses one beyond the pool)
                for active in decoding:
                    self._finish(active, active.decoder.final_event(FinishReason.LENGTH))
                return prompts, [], []
        return prompts, decoding, lengths

    def _admit(self) -> None:
        """Resume the preempted requests there is room for, then start the requests the
        scheduler lets join (and ask again when one could not start: its room is free)."""
        self._resume()
        if self._preempted:
            return  # they go on before anyone new starts
        while joining := self.scheduler.admit(self._waiting, len(self._active),
                                              self._free_blocks()):
            for admission in joining:
                stream = self._waiting.popleft()  # admission.stream
                if stream.cancelled:
                    self._outbox.send(stream, END)
                    continue
                try:
                    drafter = self.drafters[stream.drafter] if stream.drafter else None
                    if stream.request.prediction and self.predicted is not None:
                        drafter = self.predicted(stream.request.prediction, drafter)
                    decoder = SequenceDecoder(self.target, drafter, stream.request,
                                              prefix_cache=self.prefix_cache,
                                              new_policy=partial(self.scheduler.new_policy,
                                                                 stream.drafter))
                except Exception as exc:  # invalid for this model: fail this request only
                    log.exception("request %s could not start", stream.request.request_id)
                    self._end(stream, FinishReason.ERROR, str(exc))
                    continue
                self._active.append(_Active(stream, decoder, admission.deadline))

    def _finish(self, active: _Active, last: RoundEvent | None) -> None:
        active.decoder.close()
        if active.decoder.drafting is not None:  # its policies teach its drafter's priors
            self.scheduler.finished(active.stream.drafter, active.decoder.drafting.policies)
        with self._lock:  # free the slot before the client can see the end
            if active in self._active:
                self._active.remove(active)
            if active in self._preempted:
                self._preempted.remove(active)
        if last is not None:
            self._outbox.send(active.stream, last)
        self._outbox.send(active.stream, END)

    def _end(self, stream: RequestStream, reason: FinishReason, error: str | None = None
             ) -> None:
        """End a request that never ran: its one event, then the end of its stream."""
        self._outbox.send(stream, RoundEvent(
            token_ids=(), text="", draft_tokens=0, accepted_tokens=0, finish_reason=reason,
            error=error, prompt_tokens=len(stream.request.prompt_ids)))
        self._outbox.send(stream, END)

    def _drain_all(self) -> None:
        with self._lock:
            active, self._active = [*self._active, *self._preempted], []
            self._preempted = deque()
            waiting, self._waiting = list(self._waiting), deque()
        for item in active:
            item.decoder.close()
            self._outbox.send(item.stream, item.decoder.final_event(FinishReason.CANCELLED))
            self._outbox.send(item.stream, END)
        for stream in waiting:
            self._end(stream, FinishReason.ERROR, "the server is shutting down")
