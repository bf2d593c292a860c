"""Helpers shared by the batched runner, engine and batch-policy tests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from decoding.drafter import Drafter
from decoding.engine import Engine
from decoding.policy import AdaptiveSpeculation, StepCost
from decoding.prompting import encode_text
from decoding.round import decode
from decoding.types import GenerationRequest, RoundEvent, SamplingParams, SpeculationParams
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import BatchItem

GREEDY = SamplingParams(temperature=0.0)


PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Hello",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "a b a b a b a b a b a b",
    "Once upon a time " * 12,
    "x",
]


def _ids(target: CausalLM, text: str) -> tuple[int, ...]:
    return tuple(encode_text(target.tokenizer, text))


def _tokens(events: list[RoundEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _alone(target: CausalLM, drafter: Drafter | None, request: GenerationRequest) -> list[int]:
    return _tokens(list(decode(target, drafter, request)))


def _engine(target: CausalLM, drafters: dict[str, Drafter], **kw: object) -> Engine:
    kw.setdefault("default_drafter", "ngram")
    engine = Engine(target, drafters, max_active=16, max_queue=64,
                    **kw)  # type: ignore[arg-type]
    engine.start()
    return engine


def _serve(target: CausalLM, drafters: dict[str, Drafter], requests: list[GenerationRequest],
           **kw: object) -> list[list[RoundEvent]]:
    """Submit every request to a fresh engine at once; each one's events."""
    engine = _engine(target, drafters, **kw)
    try:
        streams = [engine.submit(r) for r in requests]
        return [list(s) for s in streams]
    finally:
        engine.shutdown()


def _greedy(target: CausalLM, prompts: list[str], max_new_tokens: int,
            **kw: object) -> list[GenerationRequest]:
    return [GenerationRequest(prompt_ids=_ids(target, p), max_new_tokens=max_new_tokens,
                              sampling=GREEDY, request_id=str(i), **kw)  # type: ignore[arg-type]
            for i, p in enumerate(prompts)]


def _mixed_requests(target: CausalLM) -> list[GenerationRequest]:
    """Mixed prompt lengths, drafters, budgets (some finish while others run) and
    sampling settings."""
    requests = []
    for i, prompt in enumerate(PROMPTS):
        requests.append(GenerationRequest(
            prompt_ids=_ids(target, prompt), max_new_tokens=(5, 40, 17, 33, 9, 26)[i],
            sampling=GREEDY, request_id=f"greedy-{i}",
            speculation=SpeculationParams(drafter=("ngram", "model", "ngram+model", None)[i % 4],
                                          enabled=i != 5)))
    requests.append(GenerationRequest(
        prompt_ids=_ids(target, PROMPTS[0]), max_new_tokens=30, request_id="penalties",
        sampling=SamplingParams(temperature=0.0, presence_penalty=0.8, frequency_penalty=0.5)))
    requests.append(GenerationRequest(  # seeded sampling, plain: the same draws as alone
        prompt_ids=_ids(target, PROMPTS[2]), max_new_tokens=24, request_id="sampled",
        sampling=SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7),
        speculation=SpeculationParams(enabled=False)))
    return requests


def _drafter_for(request: GenerationRequest, drafters: dict[str, Drafter]) -> Drafter | None:
    if not request.speculation.enabled:
        return None
    return drafters[request.speculation.drafter or "ngram"]


def _spy_on_draft_passes(model: BatchedLM, monkeypatch: pytest.MonkeyPatch,
                         fail_batches: bool = False) -> list[int]:
    """The sizes (sequences) of the draft model's forward passes and of its native draft
    chains, a greedy round's steps in one call (optionally failing every one of more than
    one sequence: a fault that cannot be caused from outside)."""
    sizes: list[int] = []
    real_pass, real_chain = model.forward_batch, model.draft_chain

    def spied(real: Any) -> Any:
        def call(states: Any, *args: Any) -> Any:
            sizes.append(len(states))
            if fail_batches and len(states) > 1:
                raise RuntimeError("injected draft fault")
            return real(states, *args)
        return call

    monkeypatch.setattr(model, "forward_batch", spied(real_pass))
    monkeypatch.setattr(model, "draft_chain", spied(real_chain))
    return sizes


def _policy(rate: float) -> AdaptiveSpeculation:
    """A policy that has seen every draft token kept with chance ``rate``."""
    policy = AdaptiveSpeculation()
    rng = random.Random(0)
    for _ in range(200):
        accepted = 0
        while accepted < 4 and rng.random() < rate:
            accepted += 1
        policy.update(4, accepted)
    return policy


def _cost(fixed: float, per_token: float) -> StepCost:
    cost = StepCost()
    for tokens in (1, 4, 9, 16, 40, 80, 2, 30):
        cost.observe(tokens, fixed + per_token * tokens)
    return cost


def check_alternatives(target: BatchedLM, reference: CausalLM, prompts: list[list[int]],
                       added: list[list[int]], alternative: list[bool],
                       later: Sequence[int]) -> None:
    """Rows verifying ``added`` in one pass, the last token of those marked in
    ``alternative`` an alternative for their first: the drafts' logits are those of the
    chain alone and an alternative's those it would get as the next token (``reference``
    fed them one sequence at a time); once adopted, the cache continues as if it had been
    fed. The rows are released after."""
    states = [target.new_state() for _ in prompts]
    target.forward_batch([BatchItem(s, p, 1) for s, p in zip(states, prompts, strict=True)])
    got = target.forward_batch([BatchItem(s, n, len(n), alternative=a)
                                for s, n, a in zip(states, added, alternative, strict=True)])
    for state, prompt, new, alt, logits in zip(states, prompts, added, alternative, got,
                                              strict=True):
        chain = new[:-1] if alt else new
        ref = reference.new_state()
        reference.prefill(ref, prompt)
        torch.testing.assert_close(logits[: len(chain)], reference.score(ref, chain),
                                   rtol=1e-4, atol=1e-4)
        if not alt:
            continue
        ref = reference.new_state()
        reference.prefill(ref, prompt)
        expected = reference.score(ref, [new[0], new[-1]])
        torch.testing.assert_close(logits[-1], expected[-1], rtol=1e-4, atol=1e-4)
        target.adopt_alternative(state, len(prompt), len(new))
        assert state.length == len(prompt) + 2
        torch.testing.assert_close(target.score(state, later), reference.score(ref, later),
                                   rtol=1e-4, atol=1e-4)
    for state in states:
        target.release(state)


def mixed_passes(runner: BatchedLM, prompt: Sequence[int]) -> list[torch.Tensor]:
    """The logits of a mix of passes two new sequences make: ``prompt`` for one and a
    short prompt for the other, a step, verify passes of 3 and 16 tokens beside the other
    sequence's 1 and 2; both released after."""
    a, b = runner.new_state(), runner.new_state()
    out = runner.forward_batch([BatchItem(a, list(prompt), 1)])
    out += runner.forward_batch([BatchItem(b, list(range(5, 12)), 1)])
    out += runner.forward_batch([BatchItem(a, [7], 1)])
    out += runner.forward_batch([BatchItem(a, [8, 9, 10], 3), BatchItem(b, [11], 1)])
    out += runner.forward_batch([BatchItem(a, list(range(40, 56)), 16),
                                 BatchItem(b, [12, 13], 2)])
    runner.release(a)
    runner.release(b)
    return out
