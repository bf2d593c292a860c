"""Greedy speculative decoding is token-identical to plain target decoding."""

from __future__ import annotations

import pytest
import torch

from decoding.drafter import Drafter
from decoding.policy import FixedSpeculation
from decoding.prompting import encode_chat, encode_text
from decoding.round import decode
from decoding.types import FinishReason, GenerationRequest, SamplingParams
from drafters.combined import CombinedDrafter
from drafters.model import ModelDrafter
from drafters.ngram import NgramDrafter
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import BatchItem, TargetCapabilities
from tests.policies import SteadyTimingPolicy

GREEDY = SamplingParams(temperature=0.0)
TINY_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Hello",
    "a b a b a b a b a b",
]


def _run(target: CausalLM, drafter: Drafter | None, request: GenerationRequest,
         k: int | None = 4) -> tuple[list[int], str, int, int]:
    """Decode; ``k`` fixes the draft length (so verification is exercised whatever the
    drafter costs), ``None`` lets the adaptive policy choose."""
    ids: list[int] = []
    text = ""
    drafted = accepted = 0
    policy = FixedSpeculation(k) if k is not None else None
    for event in decode(target, drafter, request, policy):
        ids.extend(event.token_ids)
        text += event.text
        drafted += event.draft_tokens
        accepted += event.accepted_tokens
    return ids, text, drafted, accepted


def _drafters(target: CausalLM, tiny_draft: CausalLM) -> dict[str, Drafter]:
    return {
        "ngram": NgramDrafter(),
        "ngram-unigram": NgramDrafter(max_ngram=3, min_ngram=1),
        "model-poor": ModelDrafter(tiny_draft, target),
        "model-self": ModelDrafter(target, target),  # full acceptance
        "ngram+model-poor": CombinedDrafter([NgramDrafter()], ModelDrafter(tiny_draft, target)),
        "ngram+model-self": CombinedDrafter([NgramDrafter()], ModelDrafter(target, target)),
    }


class _SecondBest:
    """The target as its own draft with its two likeliest tokens swapped: the first draft
    token of every round is the target's second choice, and its alternative the first."""

    capabilities = TargetCapabilities(batched=False, branches=False)

    def __init__(self, target: CausalLM) -> None:
        self.target, self.vocab_size = target, target.vocab_size
        self.tokenizer, self.name = target.tokenizer, "second-best"

    def new_state(self) -> object:
        return self.target.new_state()

    def prefill(self, state: object, token_ids: list[int]) -> torch.Tensor:
        logits = self.target.prefill(state, token_ids).clone()
        first, second = torch.topk(logits, 2).indices.tolist()
        logits[first], logits[second] = logits[second].clone(), logits[first].clone()
        return logits

    def forward_batch(self, items: list[BatchItem]) -> list[torch.Tensor]:
        return [self.prefill(item.state, list(item.token_ids))[None] for item in items]

    def rollback(self, state: object, length: int) -> None:
        self.target.rollback(state, length)

    def release(self, state: object) -> None:
        self.target.release(state)

    def warmup(self) -> None:
        return None


class _EveryAlternative(FixedSpeculation):
    """k drafts a round, and an alternative whenever the cap leaves room for one."""

    def __init__(self, k: int, cap: int) -> None:
        super().__init__(k)
        self.max_tokens = cap

    def worth_alternative(self, confidences: object, confidence: float) -> bool:
        return True


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("prompt", TINY_PROMPTS)
def test_tiny_alternatives_taken_every_round_stay_lossless(
        tiny_target: CausalLM, prompt: str, kernels: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft whose first token is always the target's second choice: each round's
    alternative (its second choice, the target's first) is taken, the cache is
    rearranged to hold it, and the output is still plain decoding's. The native kernels
    take alternatives under batch invariance; PyTorch's path only without it
    (``BatchedLM.capabilities``)."""
    assert isinstance(tiny_target, BatchedLM)
    monkeypatch.setattr(tiny_target, "batch_invariant", True)
    tiny_target.use_kernels(kernels)
    try:
        _alternatives_every_round(tiny_target, prompt, kernels, monkeypatch)
    finally:
        tiny_target.use_kernels("auto")


def _alternatives_every_round(tiny_target: BatchedLM, prompt: str, kernels: str,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert tiny_target.capabilities.branches == (kernels == "native")
    monkeypatch.setattr(tiny_target, "batch_invariant", kernels == "native")
    assert tiny_target.capabilities.branches
    ids = tuple(encode_text(tiny_target.tokenizer, prompt))
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=40, sampling=GREEDY)
    plain = _run(tiny_target, None, request)[0]
    events = list(decode(tiny_target, ModelDrafter(_SecondBest(tiny_target), tiny_target),
                         request, _EveryAlternative(3, cap=4)))
    assert [t for e in events for t in e.token_ids] == plain
    made = 1  # the prompt's round made one token
    for event in events[1:-1]:  # up to 3 drafts (no more than the budget leaves room for)
        drafts = min(3, request.max_new_tokens - made - 1)  # + the alternative verified;
        assert (event.draft_tokens, event.accepted_tokens) == (drafts + 1, 1)  # it and the
        assert len(event.token_ids) == 2  # target's token after it kept
        made += 2
    assert len(events) > 3


def test_tiny_no_alternatives_when_sampling_penalised_or_capped(
        tiny_target: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled and penalised rows after an alternative would need distributions of their
    own, so those rounds verify a chain; and an alternative counts against the round's
    cap on draft tokens."""
    monkeypatch.setattr(tiny_target, "batch_invariant", False)
    ids = tuple(encode_text(tiny_target.tokenizer, TINY_PROMPTS[0]))
    drafter = ModelDrafter(_SecondBest(tiny_target), tiny_target)
    for sampling, cap in ((SamplingParams(temperature=0.0, presence_penalty=0.5), 4),
                          (SamplingParams(temperature=0.9, seed=3), 4), (GREEDY, 3)):
        request = GenerationRequest(prompt_ids=ids, max_new_tokens=16, sampling=sampling)
        events = list(decode(tiny_target, drafter, request, _EveryAlternative(3, cap)))
        assert all(e.draft_tokens <= 3 for e in events), sampling
        assert any(e.draft_tokens == 3 for e in events), sampling


@pytest.mark.parametrize("prompt", TINY_PROMPTS)
def test_tiny_every_drafter_is_lossless(
    tiny_target: CausalLM, tiny_draft: CausalLM, prompt: str
) -> None:
    ids = tuple(encode_text(tiny_target.tokenizer, prompt))
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=48, sampling=GREEDY)
    plain = _run(tiny_target, None, request)
    assert len(plain[0]) > 0
    for name, drafter in _drafters(tiny_target, tiny_draft).items():
        spec = _run(tiny_target, drafter, request)
        assert spec[0] == plain[0], name
        assert spec[1] == plain[1], name
        assert _run(tiny_target, drafter, request, k=None)[0] == plain[0], f"{name}, adaptive"
        if name == "model-self":
            assert spec[2] > 0 and spec[3] == spec[2], "the target as its own draft: all accepted"


def test_tiny_lossless_with_penalties(tiny_target: CausalLM, tiny_draft: CausalLM) -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4)
    ids = tuple(encode_text(tiny_target.tokenizer, TINY_PROMPTS[0]))
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=40, sampling=params)
    plain = _run(tiny_target, None, request)
    for name, drafter in _drafters(tiny_target, tiny_draft).items():
        assert _run(tiny_target, drafter, request)[0] == plain[0], name


def test_tiny_speculation_actually_happens(tiny_target: CausalLM) -> None:
    ids = tuple(encode_text(tiny_target.tokenizer, TINY_PROMPTS[3]))
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=64, sampling=GREEDY)
    events = list(decode(tiny_target, ModelDrafter(tiny_target, tiny_target), request,
                         FixedSpeculation(4)))
    assert len(events) < 64 / 2, "full acceptance should commit several tokens per round"
    assert max(len(e.token_ids) for e in events) > 2


def test_seeded_sampling_is_reproducible(tiny_target: CausalLM, tiny_draft: CausalLM) -> None:
    ids = tuple(encode_text(tiny_target.tokenizer, TINY_PROMPTS[0]))
    for drafter in (None, NgramDrafter(), ModelDrafter(tiny_draft, tiny_target)):
        runs = []
        for seed in (11, 11, 12):
            params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed)
            request = GenerationRequest(prompt_ids=ids, max_new_tokens=32, sampling=params)
            runs.append(_run(tiny_target, drafter, request)[0])
        assert runs[0] == runs[1]
        assert runs[0] != runs[2]


KEYED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11)


@pytest.mark.parametrize("prompt", [TINY_PROMPTS[0], TINY_PROMPTS[3]])  # lookup drafts on both
def test_tiny_keyed_sampling_is_the_same_text_with_every_drafter(
    tiny_target: CausalLM, tiny_draft: CausalLM, prompt: str
) -> None:
    """With a seed, sampling is keyed by position: the text is the one plain sampling with
    that seed gives, token for token, whatever drafts (fixed lengths and the adaptive
    policy alike), and a draft that is always right is accepted whole. (The random model's
    sampled text seldom repeats, so lookup's rounds are the real model's test below.)"""
    ids = tuple(encode_text(tiny_target.tokenizer, prompt))
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=24, sampling=KEYED)
    plain = _run(tiny_target, None, request)
    assert len(plain[0]) == 24
    greedy = _run(tiny_target, None, GenerationRequest(prompt_ids=ids, max_new_tokens=24,
                                                       sampling=GREEDY))
    assert plain[0] != greedy[0]  # the seed's draws, not the argmax
    for name, drafter in _drafters(tiny_target, tiny_draft).items():
        spec = _run(tiny_target, drafter, request)
        assert spec[:2] == plain[:2], name
        assert spec[2] > 0 or name.startswith("ngram"), f"{name} drafted nothing"
        assert _run(tiny_target, drafter, request, k=None)[:2] == plain[:2], f"{name}, adaptive"
        if name == "model-self":  # the target's own keyed draws: all accepted
            assert spec[3] == spec[2], name


CHAT = [
    "Correct the grammar: 'She don't like apples and she go to school every days.'",
    "What is the capital of France? Answer in one sentence.",
    "Repeat this list exactly: red, green, blue, yellow, red, green, blue, yellow.",
]


@pytest.mark.real_model
@pytest.mark.parametrize("question", CHAT)
def test_real_model_fp32_lossless(
    default_target: CausalLM, tiny_draft: CausalLM, question: str
) -> None:
    ids = tuple(encode_chat(default_target.tokenizer, [{"role": "user", "content": question}]))
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=48, sampling=GREEDY)
    plain = _run(default_target, None, request)
    for drafter in (NgramDrafter(), ModelDrafter(tiny_draft, default_target)):
        assert _run(default_target, drafter, request)[:2] == plain[:2], drafter.name


@pytest.mark.real_model
def test_real_model_keyed_sampling_is_the_same_text_with_each_drafter(
    default_target: CausalLM, tiny_draft: CausalLM
) -> None:
    """The real model sampling with a seed, asked to repeat a list: lookup's drafts are
    accepted where they equal the keyed draws, and the text is plain sampling's with
    lookup, with a draft model and with both."""
    ids = tuple(encode_chat(default_target.tokenizer, [{"role": "user", "content": CHAT[2]}]))
    # this seed's answer repeats the list and goes on freely: lookup has drafts to offer,
    # and the free part has tokens whose draws depend on the position's noise
    keyed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=13)
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=32, sampling=keyed)
    plain = _run(default_target, None, request)
    greedy = _run(default_target, None, GenerationRequest(prompt_ids=ids, max_new_tokens=32,
                                                          sampling=GREEDY))
    assert plain[0] != greedy[0]  # the seed's draws, not the argmax
    drafters: list[Drafter] = [
        NgramDrafter(), ModelDrafter(tiny_draft, default_target),
        CombinedDrafter([NgramDrafter()], ModelDrafter(tiny_draft, default_target))]
    for drafter in drafters:
        spec = _run(default_target, drafter, request)
        assert spec[:2] == plain[:2], drafter.name
        assert spec[2] > 0, f"{drafter.name} drafted nothing"
        if isinstance(drafter, NgramDrafter):
            assert spec[3] > 0, "lookup's drafts of the repeated list were all refused"


@pytest.mark.real_model
def test_real_model_draft_lengths_set_by_confidence_stay_lossless(
        default_target: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped draft in bfloat16 beside the float32 target, each round as long as
    its confidence says (the adaptive policy), its second choices verified as
    alternatives (which run without batch invariance): the output is plain decoding's."""
    import torch

    monkeypatch.setattr(default_target, "batch_invariant", False)

    from wiring.drafts import load_model_drafter

    drafter = load_model_drafter("default-draft", default_target, "float32", "bfloat16")
    assert next(drafter.model.model.parameters()).dtype == torch.bfloat16  # type: ignore[attr-defined]
    lengths: set[int] = set()
    policy = SteadyTimingPolicy()  # measured timings made a loaded machine draft only 0 or 4
    for question in CHAT[:2]:
        ids = tuple(encode_chat(default_target.tokenizer, [{"role": "user", "content": question}]))
        request = GenerationRequest(prompt_ids=ids, max_new_tokens=48, sampling=GREEDY)
        events = list(decode(default_target, drafter, request, policy))
        plain = _run(default_target, None, request)
        assert [t for e in events for t in e.token_ids] == plain[0]
        lengths.update(e.draft_tokens for e in events[1:])
    assert len(lengths - {0}) >= 2, f"every round drafted alike: {lengths}"
    assert policy.alternatives.verified > 0  # the draft's second choices were verified too


@pytest.mark.real_model
def test_real_model_eos_ends_the_answer(default_target: CausalLM) -> None:
    ids = tuple(encode_chat(default_target.tokenizer, [{"role": "user", "content": CHAT[1]}]))
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=64, sampling=GREEDY)
    events = list(decode(default_target, NgramDrafter(), request))
    assert events[-1].finish_reason is FinishReason.STOP
    assert events[-1].token_ids[-1] in default_target.eos_token_ids
    text = "".join(e.text for e in events)
    assert "Paris" in text and "<|im_end|>" not in text
