"""Batch invariance: a pass that verifies k tokens of a sequence, alone or beside other
sequences at other lengths (and prompt chunks), gives each position bitwise the logits
that a one-token step of that sequence alone gives, in every precision served.

The default model runs here in each precision (its GGUF's own int4 weights, bfloat16
and float32): the invariance is a property of the kernels at the real shapes, which a
toy model would not exercise (its 1,536-input down projection, 512-key attention
blocks, a 49,152-row head)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from decoding.drafter import Drafter
from decoding.engine import Engine
from decoding.invariance import InvarianceCheck
from decoding.policy import AdaptiveSpeculation, FixedSpeculation
from decoding.prompting import encode_chat
from decoding.scheduler import Scheduler
from decoding.types import GenerationRequest, SamplingParams
from drafters.ngram import NgramDrafter
from runtime.loaders.loading import load_target
from runtime.runner.causal_lm import CausalLM
from runtime.runner.layout import Layout
from runtime.runner.passes import BatchItem, PreparedPass

GREEDY = SamplingParams(temperature=0.0)

# sequence lengths chosen so that passes cross the 512-key attention blocks
LENGTHS = (40, 170, 505)
FUTURE = 20


@pytest.fixture(scope="module", params=[("bfloat16", "auto", "auto", True),
                                        ("bfloat16", "auto", "auto", False),
                                        ("bfloat16", "none", "auto", True),
                                        ("float32", "none", "auto", True),
                                        ("bfloat16", "auto", "torch", True)],
                ids=["gguf-int4", "gguf-int4-bfloat16-activations", "bfloat16", "float32",
                     "gguf-int4-torch-kernels"])
def target(request: pytest.FixtureRequest, default_model_dir: object) -> CausalLM:
    """Each precision on the fused kernels where they build (the GGUF's matrices with int8
    activations where the kernels have block products, and without), and the GGUF on
    PyTorch's ops (the path without a compiler)."""
    dtype, quantize, kernels, int8_activations = request.param
    return load_target("default", dtype, "cpu", quantize, kernels, int8_activations)


def _steps(target: CausalLM, state: object, tokens: Sequence[int]) -> list[torch.Tensor]:
    return [target.forward_batch([BatchItem(state, [t], 1)])[0][0].clone() for t in tokens]


def test_verify_passes_give_one_token_logits_bitwise(target: CausalLM) -> None:
    """Random ragged batches of 1-3 sequences, each adding 1-9 tokens (a prompt chunk
    riding along in some), against one-token steps of each sequence alone."""
    rng = random.Random(0)
    vocab = range(100, 40000)
    prompts = [[rng.choice(vocab) for _ in range(n)] for n in LENGTHS]
    futures = [[rng.choice(vocab) for _ in range(FUTURE)] for _ in LENGTHS]
    states = [target.new_state() for _ in LENGTHS]
    extra = target.new_state()  # a prompt chunk sharing some passes
    try:
        alone = []
        for state, prompt, future in zip(states, prompts, futures, strict=True):
            target.forward_batch([BatchItem(state, prompt, 1)])
            alone.append(_steps(target, state, future))
            target.rollback(state, len(prompt))
        checked = 0
        for _ in range(20):
            members = rng.sample(range(len(LENGTHS)), rng.randint(1, len(LENGTHS)))
            adds = {i: (rng.randrange(0, 10), rng.choice([1, 2, 3, 5, 8, 9])) for i in members}
            for i, (offset, _) in adds.items():  # the cache as one-token steps left it
                target.rollback(states[i], LENGTHS[i])
                _steps(target, states[i], futures[i][:offset])
            items = [BatchItem(states[i], futures[i][o : o + k], k) for i, (o, k) in adds.items()]
            riding = rng.random() < 0.3
            if riding:
                target.rollback(extra, 0)
                chunk = rng.choice([40, 300])
                items.append(BatchItem(extra, [rng.choice(vocab) for _ in range(chunk)], 1))
            outputs = target.forward_batch(items)
            for (i, (offset, k)), logits in zip(adds.items(), outputs, strict=False):
                for j in range(k):
                    assert torch.equal(logits[j], alone[i][offset + j]), (
                        f"sequence {i} (length {LENGTHS[i]}), offset {offset}, {k} tokens, "
                        f"beside {sorted(adds)}{' and a prompt chunk' if riding else ''}: "
                        f"position {j} differs from its one-token step")
                    checked += 1
        assert checked > 100
    finally:
        for state in (*states, extra):
            target.release(state)


PROMPTS = ["Explain how a rainbow forms, in three sentences.",
           "List five fruits and their colours.",
           "Write a haiku about the sea.",
           "What is the capital of France? Answer and then describe the city."]


class _AlwaysDrafting(Scheduler):
    """A scheduler whose requests draft whenever their drafter has tokens to propose:
    the adaptive policy's choice depends on measured timings, and a loaded machine can make
    it skip the drafts this test is about."""

    def new_policy(self, drafter: str | None, source: str) -> AdaptiveSpeculation:
        return FixedSpeculation(4)


def _engine_tokens(target: CausalLM, drafters: dict[str, Drafter], default: str | None,
                   streams: int, check: InvarianceCheck | None) -> list[list[int]]:
    engine = Engine(target, drafters, default_drafter=default, max_queue=8,
                    max_active=streams, invariance_check=check, batch_planning=False)
    engine.scheduler = _AlwaysDrafting(engine.scheduler.kv_budget, streams,
                                       batch_planning=False)
    engine.start()
    try:
        requests = [GenerationRequest(prompt_ids=tuple(encode_chat(target.tokenizer, [
            {"role": "user", "content": p}])), max_new_tokens=64, sampling=GREEDY)
            for p in PROMPTS]
        submitted = [engine.submit(r) for r in requests]
        return [[t for e in s for t in e.token_ids] for s in submitted]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("streams", [1, 4])
def test_speculation_equals_plain_and_the_run_time_check_finds_nothing(
        target: CausalLM, streams: int) -> None:
    """Greedy through the engine, n-gram drafts, every round checked against a one-token
    step: no mismatch, and the tokens are plain decoding's (one stream at a time)."""
    plain = _engine_tokens(target, {}, None, 1, None)
    check = InvarianceCheck(1.0, seed=0)
    got = _engine_tokens(target, {"ngram": NgramDrafter()}, "ngram", streams, check)
    assert got == plain
    assert check.stats.checks >= 5  # rounds that verified drafts (or shared the pass)
    assert check.stats.mismatches == 0


def test_the_run_time_check_counts_a_pass_that_is_not_invariant(
        tiny_target: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner whose passes of several tokens shift their logits (a fault the real
    kernels cannot be made to show on demand): the check counts mismatches, and the
    recompute leaves each sequence as plain decoding would continue it."""
    real = tiny_target.run_pass

    def shifted(prepared: PreparedPass) -> list[torch.Tensor]:
        out = real(prepared)
        if sum(len(item.token_ids) for item in prepared.items) > 1:
            out = [logits + 1e-3 for logits in out]
        return out

    monkeypatch.setattr(tiny_target, "run_pass", shifted)
    check = InvarianceCheck(1.0, seed=0)
    _engine_tokens(tiny_target, {"ngram": NgramDrafter()}, "ngram", 2, check)
    assert check.stats.checks > 0
    assert check.stats.mismatches == check.stats.checks


def test_the_check_rate_is_a_fraction() -> None:
    with pytest.raises(ValueError, match=r"within 0\.\.1"):
        InvarianceCheck(1.5)
    never = InvarianceCheck(0.0)
    assert not any(never.sample() for _ in range(100))


def test_prompt_chunks_take_the_bulk_products_only_without_invariance(
        tiny_target: CausalLM) -> None:
    """A 300-token prompt chunk beside a decoding round: with invariance every row takes
    the row-exact products (a prompt's keys and values must not depend on how it was
    chunked); without it the prompt's rows take the bulk ones, the round's never."""
    rows = [tiny_target.new_state() for _ in range(2)]
    try:
        tiny_target.forward_batch([BatchItem(rows[1], [5] * 10, 1)])
        items = [BatchItem(rows[0], [7] * 300, 1), BatchItem(rows[1], [6] * 3, 3)]
        exact = Layout.build(items, tiny_target.device, invariant=True)
        fast = Layout.build(items, tiny_target.device, invariant=False)
        assert exact.bulk_from == 303
        assert fast.bulk_from == 3 and fast.offsets == [3, 0]  # the round's rows first
        assert min(g.width for g in exact.groups) >= 2
        assert all(g.span % 512 == 0 for g in exact.groups)
    finally:
        for state in rows:
            tiny_target.release(state)
