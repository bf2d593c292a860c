"""Answers and their features in one go: up to ``streams`` answers grow together on the
batched runner, and every pass keeps the hidden states of the positions it adds.

A job is a prompt and the answers wanted to it (one per temperature, each with its own
seed). Its prompt joins a pass whole, with its features; the logits after it give every
answer's first token, and the answers past the first continue from a copy of the
prompt's KV rows (``load_kv``), so a prompt is run once however many answers it gets.
An answer that has ended feeds its last token once more, for that position's features
only (no logits), and leaves. Greedy answers take the argmax; sampled ones draw among
the ``TOP_K`` most likely tokens at their temperature from their own seeded generator,
so an answer never depends on what shares its passes (the runner is batch invariant).

When a job finishes, ``on_done`` may return follow-up jobs (a conversation's next
turn); they go to the front of the queue. When the queue runs dry, ``refill`` gives the
next jobs (an empty list ends the run), so the streams stay full across rounds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.runner.passes import BatchItem

TOP_K = 40  # sampled tokens are drawn among this many of the most likely


@dataclass(frozen=True)
class Job:
    prompt: Sequence[int]
    temperatures: Sequence[float]  # one answer per entry: 0 greedy
    seeds: Sequence[int]  # one per answer (unused for greedy ones)
    max_new_tokens: int
    features: bool = True  # keep the prompt's and the answers' features
    tag: Any = None  # the caller's


@dataclass
class Answer:
    temperature: float
    tokens: list[int] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)  # [n_i, H] float16 pieces
    layers: list[torch.Tensor] = field(default_factory=list)  # [n_i, layers * H] float16

    @property
    def ended(self) -> bool:
        return bool(self.tokens) and self.tokens[-1] in _STOP


_STOP: set[int] = set()  # the target's end tokens (set by grow)


@dataclass
class Done:
    job: Job
    answers: list[Answer]
    prompt_features: torch.Tensor | None  # [P, H] float16
    prompt_layers: torch.Tensor | None  # [P, layers * H] float16


@dataclass
class GrowStats:
    passes: int = 0
    pass_seconds: float = 0.0  # inside the runner's passes
    seconds: float = 0.0  # all of grow
    answer_tokens: int = 0  # tokens sampled for answers (features kept or not)
    feature_positions: int = 0
    prompt_tokens: int = 0
    rows: int = 0  # sequences summed over passes (the mean batch: rows / passes)
    positions: int = 0  # tokens the passes added (prompts, answers, user messages)


@dataclass
class _Running:
    owner: _Job
    answer: Answer
    state: Any
    feed: list[int]
    generator: torch.Generator | None
    closing: bool = False  # fed its last token for the features only
    prompt: bool = False  # its feed is the job's prompt


class _Job:
    """A job in flight: how many of its answers still run."""

    def __init__(self, done: Done) -> None:
        self.done = done
        self.left = len(done.answers)


def _half(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float16)


@torch.inference_mode()
def grow(target: Any, jobs: Iterable[Job], streams: int,
         on_done: Callable[[Done], Iterable[Job]],
         refill: Callable[[], list[Job]] | None = None,
         on_pass: Callable[[GrowStats], None] | None = None) -> GrowStats:
    """Run every job (and its follow-ups) to the end; see the module's docstring."""
    _STOP.clear()
    _STOP.update(int(t) for t in target.eos_token_ids)
    queue: deque[Job] = deque(jobs)
    running: list[_Running] = []
    stats = GrowStats()
    started = time.perf_counter()
    try:
        while True:
            if not queue and refill is not None:
                queue.extend(refill())
            # answers in flight, counting those a prompt in this pass will fork
            busy = sum(len(r.owner.done.answers) if r.prompt else 1 for r in running)
            while queue and (busy + len(queue[0].temperatures) <= streams or not running):
                job = queue.popleft()
                done = Done(job, [Answer(float(t)) for t in job.temperatures], None, None)
                running.append(_Running(_Job(done), done.answers[0], target.new_state(),
                                        list(job.prompt), _generator(job, 0), prompt=True))
                busy += len(job.temperatures)
                stats.prompt_tokens += len(job.prompt)
            if not running:
                break
            items = [BatchItem(r.state, r.feed, 0 if r.closing else 1,
                               features=r.owner.done.job.features) for r in running]
            t0 = time.perf_counter()
            prepared = target.prepare_pass(items)
            logits = target.run_pass(prepared)
            stats.pass_seconds += time.perf_counter() - t0
            stats.passes += 1
            stats.rows += len(items)
            stats.positions += sum(len(item.token_ids) for item in items)
            layers = prepared.layers or [None] * len(items)
            drawing: list[_Running] = []  # those that take a token now, and their logits
            draw_logits: list[torch.Tensor] = []
            for row, r in enumerate(running):
                feats, lays = prepared.features[row], layers[row]
                if feats is not None:
                    stats.feature_positions += len(r.feed)
                if r.prompt:
                    r.owner.done.prompt_features = _half(feats)
                    r.owner.done.prompt_layers = _half(lays)
                    r.prompt = False
                    for k in range(1, len(r.owner.done.answers)):
                        state = target.new_state()
                        target.load_kv(state, target.kv(r.state))
                        drawing.append(_Running(r.owner, r.owner.done.answers[k], state, [],
                                                _generator(r.owner.done.job, k)))
                        draw_logits.append(logits[row])
                elif feats is not None:
                    r.answer.features.append(feats.to(torch.float16))
                    if lays is not None:
                        r.answer.layers.append(lays.to(torch.float16))
                if r.closing:
                    target.release(r.state)
                    _finish(r.owner, queue, on_done)
                else:
                    drawing.append(r)
                    draw_logits.append(logits[row])
            tokens = _choose(draw_logits, drawing)
            running = []
            for r, token in zip(drawing, tokens, strict=True):
                if _advance(target, r, token, queue, on_done, stats):
                    running.append(r)
            if on_pass is not None:
                stats.seconds = time.perf_counter() - started
                on_pass(stats)
    finally:
        for r in running:
            target.release(r.state)
    stats.seconds = time.perf_counter() - started
    return stats


def _generator(job: Job, k: int) -> torch.Generator | None:
    if job.temperatures[k] == 0:
        return None
    return torch.Generator().manual_seed(int(job.seeds[k]))


def _choose(logits: Sequence[torch.Tensor], running: Sequence[_Running]) -> list[int]:
    """The next token of each answer from its logits (``[1, vocab]`` each): the argmax, or
    a draw among the ``TOP_K`` most likely at the answer's temperature."""
    if not running:
        return []
    kept = torch.cat(list(logits)).float()  # [rows, vocab]
    out = kept.argmax(-1).tolist()
    sampled = [i for i, r in enumerate(running) if r.answer.temperature > 0]
    if sampled:
        values, ids = kept[sampled].topk(TOP_K, dim=-1)  # [s, TOP_K]
        temps = torch.tensor([running[i].answer.temperature for i in sampled])[:, None]
        probs = torch.softmax(values / temps, dim=-1)
        for j, i in enumerate(sampled):
            pick = torch.multinomial(probs[j], 1, generator=running[i].generator)
            out[i] = int(ids[j, pick])
    return [int(t) for t in out]


def _advance(target: Any, r: _Running, token: int, queue: deque[Job],
             on_done: Callable[[Done], Iterable[Job]], stats: GrowStats) -> bool:
    """Append ``token`` to the answer; whether it runs on (to grow, or to close: one more
    pass for its last position's features), else it has finished."""
    r.answer.tokens.append(token)
    r.feed = [token]
    stats.answer_tokens += 1
    if token in _STOP or len(r.answer.tokens) >= r.owner.done.job.max_new_tokens:
        if not r.owner.done.job.features:
            target.release(r.state)
            _finish(r.owner, queue, on_done)
            return False
        r.closing = True
    return True


def _finish(owner: _Job, queue: deque[Job], on_done: Callable[[Done], Iterable[Job]]) -> None:
    owner.left -= 1
    if owner.left == 0:
        queue.extendleft(reversed(list(on_done(owner.done))))
