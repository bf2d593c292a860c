"""Sampled speculative decoding follows the target's distribution, end to end.

Requests are decoded over many seeds through the decoder with a real model
drafter (eight draft tokens a round, so the tenth token is a bonus when all are
kept). For each sample and position the target's own processed distribution
given that sample's prefix is computed by one scoring pass, and a chi-square
test compares the tokens seen at each position, alone and paired with the token
before, with what those distributions expect (a sum of non-identical categorical
draws has less variance than a multinomial, so the test is conservative). The
same test must reject two planted bugs: the bonus token drawn from the wrong row,
and a drafter proposing its argmax while reporting its full distribution.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
import torch
from scipy.stats import chi2

import decoding.verify
from decoding.drafter import DraftContext, Drafter
from decoding.policy import FixedSpeculation
from decoding.prompting import encode_text
from decoding.round import decode
from decoding.sampling import apply_penalties, logits_to_probs, output_counts
from decoding.types import GenerationRequest, SamplingParams
from drafters.model import ModelDrafter
from runtime.runner.causal_lm import CausalLM

K = 8
NEW_TOKENS = K + 2  # the prompt's token, eight drafts, the bonus
PROMPT = "Hello"
ALPHA = 1e-4  # per test; about 20 tests a run
TOP_K = SamplingParams(temperature=1.0, top_k=6)
NUCLEUS_PENALISED = SamplingParams(temperature=0.8, top_p=0.8, presence_penalty=0.8,
                                   frequency_penalty=0.4)


def _samples(target: CausalLM, drafter: Drafter | None, params: SamplingParams, seeds: int
             ) -> list[list[int]]:
    ids = tuple(encode_text(target.tokenizer, PROMPT))
    out = []
    for seed in range(seeds):
        sampling = replace(params, seed=seed)
        request = GenerationRequest(prompt_ids=ids, max_new_tokens=NEW_TOKENS, sampling=sampling)
        out.append([t for e in decode(target, drafter, request, FixedSpeculation(K))
                    for t in e.token_ids])
    return out


@torch.inference_mode()
def _target_probs(target: CausalLM, params: SamplingParams, output: list[int]
                  ) -> torch.Tensor:  # [len(output), vocab]
    """The target's distribution at each output position, given the output before it."""
    ids = list(encode_text(target.tokenizer, PROMPT))
    state = target.new_state()
    try:
        logits = target.score(state, [*ids, *output[:-1]])[len(ids) - 1:]  # [n, vocab]
    finally:
        target.release(state)
    counts = output_counts([], logits.shape[-1], logits.device)
    return logits_to_probs(apply_penalties(logits, counts, output[:-1], params), params)


def _pearson(observed: Counter[Any], expected: dict[Any, float]) -> float:
    """The p-value of observed against expected counts, categories under 5 expected
    pooled (with anything seen where nothing was expected)."""
    big = [c for c, e in expected.items() if e >= 5]
    if len(big) < 2:
        return 1.0
    pooled_e = sum(e for c, e in expected.items() if e < 5)
    pooled_o = sum(o for c, o in observed.items() if c not in big)
    stat = sum((observed[c] - expected[c]) ** 2 / expected[c] for c in big)
    cells = len(big)
    if pooled_e >= 1:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    elif pooled_o > 2 * pooled_e + 3:  # tokens the target (almost) never gives
        return 0.0
    return float(chi2.sf(stat, cells - 1))


def _p_values(target: CausalLM, params: SamplingParams, samples: list[list[int]]
              ) -> dict[str, float]:
    """Chi-square p-values. Per position t, the rank of each sample's token in the
    target's distribution there (0: its likeliest; every sample's own distribution,
    given its own prefix), alone (``t3``) and paired with the rank before (``t3|t2``);
    and for the first two positions, whose distributions few prefixes share, the
    tokens themselves (``token t0``, ``token t1|t0``)."""
    observed: dict[str, Counter[Any]] = defaultdict(Counter)
    expected: dict[str, dict[Any, float]] = defaultdict(lambda: defaultdict(float))
    for output in samples:  # one ended early by end-of-text counts where it reached
        probs = _target_probs(target, params, output)  # [n, vocab]
        # A token's rank: how many tokens are likelier (ties have probability zero).
        ranks = [int((probs[t] > probs[t, token]).sum()) for t, token in enumerate(output)]
        for t in range(len(output)):
            kept = probs[t][probs[t] > 1e-6]
            row = list(enumerate(torch.sort(kept, descending=True).values.tolist()))
            cells = [(f"t{t}", None)]
            if t:
                cells.append((f"t{t}|t{t - 1}", ranks[t - 1]))
            for name, before in cells:
                observed[name][(before, ranks[t])] += 1
                for r, p in row:
                    expected[name][(before, r)] += p
        tokens = [("token t0", None, probs[0])]
        if len(output) > 1:
            tokens.append(("token t1|t0", output[0], probs[1]))
        for name, before, row_probs in tokens:
            t = 0 if before is None else 1
            observed[name][(before, output[t])] += 1
            support = torch.nonzero(row_probs > 1e-6).flatten()
            for j, p in zip(support.tolist(), row_probs[support].tolist(), strict=True):
                expected[name][(before, j)] += p
    return {name: _pearson(observed[name], expected[name]) for name in observed}


def _assert_exact(p_values: dict[str, float]) -> None:
    bad = {name: p for name, p in p_values.items() if p < ALPHA}
    assert not bad, f"positions off the target's distribution: {bad}"


def _assert_caught(p_values: dict[str, float]) -> None:
    assert min(p_values.values()) < ALPHA, f"a planted bug went unseen: {p_values}"


class _ArgmaxDrafter(ModelDrafter):
    """Planted bug: proposes its argmax but reports the full distribution it samples."""

    def _pick(self, logits: torch.Tensor, context: DraftContext, runner_up: bool = False,
              position: int = 0) -> tuple[int, torch.Tensor | None, float, Any]:
        _, probs, confidence, second = super()._pick(logits, context, runner_up, position)
        assert probs is not None
        return int(probs.argmax().item()), probs, confidence, second


@contextmanager
def _bonus_from_the_wrong_row() -> Iterator[None]:
    """Planted bug: verification draws the bonus token from the row before its own."""
    real: Callable[..., Any] = decoding.verify.verify

    def buggy(draft_tokens: Any, draft_probs: Any, target_probs: torch.Tensor,
              *rest: Any, **kw: Any) -> Any:
        k = len(draft_tokens)
        if k:
            target_probs = torch.cat([target_probs[:k], target_probs[k - 1 : k]])
        return real(draft_tokens, draft_probs, target_probs, *rest, **kw)

    holders = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("decoding")
               and getattr(m, "verify", None) is real]
    assert holders, "no decoding module calls verify()"
    for module in holders:
        module.verify = buggy  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in holders:
            module.verify = real  # type: ignore[attr-defined]


SEEDS = 300  # enough: each planted bug gives p < 1e-10 at 300 (docs/sampling.md)


@pytest.fixture(scope="module")
def plain_top_k(tiny_target: CausalLM) -> list[list[int]]:
    return _samples(tiny_target, None, TOP_K, SEEDS)


def test_plain_keyed_sampling_is_exact(tiny_target: CausalLM,
                                       plain_top_k: list[list[int]]) -> None:
    _assert_exact(_p_values(tiny_target, TOP_K, plain_top_k))


def test_keyed_with_the_target_as_draft_is_plain_decoding_and_exact(
        tiny_target: CausalLM, plain_top_k: list[list[int]]) -> None:
    """Every draft kept, so every sample's tenth token is a bonus."""
    drafted = _samples(tiny_target, ModelDrafter(tiny_target, tiny_target), TOP_K, SEEDS)
    assert drafted == plain_top_k
    with _bonus_from_the_wrong_row():
        buggy = _samples(tiny_target, ModelDrafter(tiny_target, tiny_target), TOP_K, SEEDS)
    p_values = _p_values(tiny_target, TOP_K, buggy)
    _assert_caught(p_values)
    assert p_values[f"t{NEW_TOKENS - 1}"] < ALPHA  # seen where it is: at the bonus


@pytest.mark.slow  # top-p's wide support makes the reference sums long: the long suite only
def test_keyed_with_a_poor_draft_under_nucleus_and_penalties(
        tiny_target: CausalLM, tiny_draft: CausalLM) -> None:
    params = NUCLEUS_PENALISED
    plain = _samples(tiny_target, None, params, SEEDS)
    drafted = _samples(tiny_target, ModelDrafter(tiny_draft, tiny_target), params, SEEDS)
    assert drafted == plain
    _assert_exact(_p_values(tiny_target, params, drafted))
    # An argmax draft is only proposed, never trusted: the text stays the same.
    assert _samples(tiny_target, _ArgmaxDrafter(tiny_draft, tiny_target), params, 50) \
        == plain[:50]


@pytest.mark.parametrize("draft", [
    "self", pytest.param("poor", marks=pytest.mark.slow)])  # poor: the long suite only
def test_rejection_sampling_is_exact_and_the_test_sees_both_bugs(
        tiny_target: CausalLM, tiny_draft: CausalLM, draft: str) -> None:
    params = replace(TOP_K, keyed=False)
    model = tiny_target if draft == "self" else tiny_draft
    _assert_exact(_p_values(tiny_target, params,
                            _samples(tiny_target, ModelDrafter(model, tiny_target), params,
                                     SEEDS)))
    _assert_caught(_p_values(tiny_target, params, _samples(
        tiny_target, _ArgmaxDrafter(model, tiny_target), params, SEEDS)))
    if draft == "self":  # the bonus is reached every round only when every draft is kept
        with _bonus_from_the_wrong_row():
            buggy = _samples(tiny_target, ModelDrafter(model, tiny_target), params, SEEDS)
        _assert_caught(_p_values(tiny_target, params, buggy))
