"""The ONNX Runtime drafter behaves like ModelDrafter, and speculation stays lossless."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from decoding.drafter import DraftContext, Drafter
from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams
from drafters.model import ModelDrafter
from runtime.runner.causal_lm import CausalLM
from trt.kv_drafter import KVCache, KVDrafter
from trt.onnx_drafter import load_onnx_drafter

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]


def _tokens(target: CausalLM, drafter: Drafter | None, request: GenerationRequest
            ) -> tuple[list[int], int, int]:
    ids: list[int] = []
    drafted = accepted = 0
    for event in decode(target, drafter, request):
        ids.extend(event.token_ids)
        drafted += event.draft_tokens
        accepted += event.accepted_tokens
    return ids, drafted, accepted


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculation_is_lossless(tiny_target: CausalLM, tiny_draft_export: Path,
                                        tiny_target_export: Path, prompt: str) -> None:
    request = GenerationRequest(prompt_ids=tuple(tiny_target.tokenizer.encode(prompt)),
                                max_new_tokens=32, sampling=GREEDY)
    plain, _, _ = _tokens(tiny_target, None, request)
    # A poor draft: most proposals are rejected, so rollback runs every round.
    poor = load_onnx_drafter(tiny_draft_export, tiny_target)
    assert _tokens(tiny_target, poor, request)[0] == plain
    # The target itself as the draft: nearly everything is accepted (the export runs on
    # ONNX Runtime, whose float32 rounding is not the runner's, so a near tie between two
    # tokens can go the other way now and then; the output stays the target's).
    perfect = load_onnx_drafter(tiny_target_export, tiny_target)
    ids, drafted, accepted = _tokens(tiny_target, perfect, request)
    assert ids == plain
    assert drafted > 0 and accepted >= 0.8 * drafted


def _context(tokens: list[int], params: SamplingParams = GREEDY,
             seed: int | None = None) -> DraftContext:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return DraftContext(tokens, params, generator)


def test_proposals_and_rollback_match_model_drafter(tiny_target: CausalLM, tiny_draft: CausalLM,
                                                    tiny_draft_export: Path) -> None:
    onnx = load_onnx_drafter(tiny_draft_export, tiny_target)
    model = ModelDrafter(tiny_draft, tiny_target)
    prompt = tiny_target.tokenizer.encode(PROMPTS[0])
    onnx_state, model_state = onnx.begin(prompt), model.begin(prompt)
    tokens = list(prompt)
    for round_index in range(4):
        got = onnx.propose(onnx_state, _context(tokens), 5)
        expected = model.propose(model_state, _context(tokens), 5)
        assert got.tokens == expected.tokens and got.probs is None
        # Partial acceptance: keep `round_index` drafts, then a token the draft did not pick.
        kept = list(got.tokens[:round_index])
        tokens += [*kept, (got.tokens[round_index] + 1) % tiny_target.vocab_size]
        onnx.rollback(onnx_state, len(tokens))
        model.rollback(model_state, len(tokens))
        assert onnx_state.fed == model_state.fed
        assert onnx_state.cache.length == len(onnx_state.fed)
        assert all(t.shape[2] == len(onnx_state.fed) for t in onnx_state.cache.tensors)


def test_rolled_back_cache_equals_a_fresh_one(tiny_target: CausalLM, tiny_draft_export: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    drafter = load_onnx_drafter(tiny_draft_export, tiny_target)
    prompt = tiny_target.tokenizer.encode(PROMPTS[1])
    state = drafter.begin(prompt)
    first = drafter.propose(state, _context(list(prompt)), 6)  # feeds prompt + 5 drafts
    committed = [*prompt, *first.tokens[:2]]
    drafter.rollback(state, len(committed))
    assert state.cache.length == len(committed) and state.fed == committed
    steps = _count_steps(drafter, monkeypatch)
    reused = drafter.propose(state, _context([*committed, 7]), 3)
    assert steps[0] == 3  # only the new token, then 2 drafts: the rolled-back cache was reused
    fresh = drafter.propose(drafter.begin(prompt), _context([*committed, 7]), 3)
    assert reused.tokens == fresh.tokens


def _count_steps(drafter: KVDrafter, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    step = drafter.engine.step

    def counting(cache: KVCache, token_ids: Sequence[int]) -> torch.Tensor:  # [vocab]
        calls[0] += 1
        return step(cache, token_ids)

    monkeypatch.setattr(drafter.engine, "step", counting)
    return calls


def test_sampling_returns_the_distributions(tiny_target: CausalLM, tiny_draft: CausalLM,
                                            tiny_draft_export: Path) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3)
    onnx = load_onnx_drafter(tiny_draft_export, tiny_target)
    model = ModelDrafter(tiny_draft, tiny_target)
    prompt = tiny_target.tokenizer.encode(PROMPTS[0])
    got = onnx.propose(onnx.begin(prompt), _context(list(prompt), params, seed=11), 4)
    expected = model.propose(model.begin(prompt), _context(list(prompt), params, seed=11), 4)
    assert got.probs is not None and expected.probs is not None
    assert got.probs.shape == (4, tiny_target.vocab_size)
    assert torch.all(got.probs >= 0)
    assert torch.allclose(got.probs.sum(dim=-1), torch.ones(4), atol=1e-5)
    assert all(float(got.probs[i, t]) > 0 for i, t in enumerate(got.tokens))
    assert torch.allclose(got.probs, expected.probs, atol=1e-4)
    assert got.tokens == expected.tokens  # the same generator draws give the same tokens


def test_sampled_speculation_runs_to_the_end(tiny_target: CausalLM,
                                             tiny_target_export: Path) -> None:
    drafter = load_onnx_drafter(tiny_target_export, tiny_target)
    request = GenerationRequest(prompt_ids=tuple(tiny_target.tokenizer.encode("Hello")),
                                max_new_tokens=24,
                                sampling=SamplingParams(temperature=0.7, seed=5))
    ids, drafted, accepted = _tokens(tiny_target, drafter, request)
    assert 0 < len(ids) <= 24
    assert drafted > 0 and accepted > 0


def test_release_empties_the_cache(tiny_target: CausalLM, tiny_draft_export: Path) -> None:
    drafter = load_onnx_drafter(tiny_draft_export, tiny_target)
    state = drafter.begin([1, 2, 3])
    drafter.propose(state, _context([1, 2, 3]), 2)
    drafter.release(state)
    assert state.fed == [] and state.cache.length == 0
