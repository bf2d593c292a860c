"""Qwen2.5-Coder-1.5B-Instruct with its 0.5B sibling as the draft, from the catalogue:
loading, the ChatML template, the end tokens and sampling values the pull wrote, and
greedy speculation that is plain decoding token for token. Runs where both are pulled
(`specserve models pull qwen2.5-coder-1.5b`, `specserve models pull qwen2.5-coder-0.5b`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from decoding.drafter import Drafter
from decoding.policy import FixedSpeculation
from decoding.prompting import encode_chat
from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams
from drafters.model import ModelDrafter, TokenizerMismatchError
from drafters.ngram import NgramDrafter
from gateway.decode.params import SamplingDefaults, model_stops, sampling_defaults
from runtime.files import model_store
from runtime.loaders.loading import load_target
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from wiring.drafts import load_drafter

TARGET = model_store.QWEN_CODER_1_5B
DRAFT = model_store.QWEN_CODER_0_5B
IM_END, END_OF_TEXT = 151645, 151643
PROMPT = [{"role": "user", "content": "Write a Python function that reverses a string."}]

pytestmark = pytest.mark.skipif(
    not TARGET.pulled(), reason=f"needs `specserve models pull {TARGET.name}`")
needs_draft = pytest.mark.skipif(  # (where the target is missing, its reason is given)
    TARGET.pulled() and not DRAFT.pulled(), reason=f"needs `specserve models pull {DRAFT.name}`")


@pytest.fixture(scope="module")
def qwen() -> CausalLM:
    return load_target(TARGET.name, quantize="auto")  # the file's own Q4_K_M weights


def test_the_target_loads_with_its_end_tokens_and_sampling(qwen: CausalLM) -> None:
    assert isinstance(qwen, BatchedLM) and qwen.weights_format.startswith("gguf-")
    assert "q4_k" in qwen.weights_format
    assert qwen.vocab_size == 151936
    assert {IM_END, END_OF_TEXT} <= qwen.eos_token_ids
    assert qwen.name == str(TARGET.location())
    assert sampling_defaults("model", qwen.name) == SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=20, source="generation_config.json")
    assert model_stops(qwen.name) == ()  # its end tokens end an answer, no strings needed


def test_the_chat_template_writes_im_start_turns(qwen: CausalLM) -> None:
    text = str(qwen.tokenizer.decode(encode_chat(qwen.tokenizer, PROMPT)))
    assert "<|im_start|>system\n" in text
    assert f"<|im_start|>user\n{PROMPT[0]['content']}<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


@needs_draft
def test_greedy_with_the_0_5b_draft_is_plain_decoding(qwen: CausalLM) -> None:
    drafter = load_drafter(DRAFT.name, qwen)
    assert isinstance(drafter, ModelDrafter) and isinstance(drafter.model, BatchedLM)
    assert drafter.model.weights_format.startswith("gguf-")  # the file's own Q5_0 weights
    assert drafter.target_vocab == qwen.vocab_size
    request = GenerationRequest(prompt_ids=tuple(encode_chat(qwen.tokenizer, PROMPT)),
                                max_new_tokens=32, sampling=SamplingParams(temperature=0.0))
    plain = [t for event in decode(qwen, None, request) for t in event.token_ids]
    events = list(decode(qwen, drafter, request))
    assert [t for event in events for t in event.token_ids] == plain
    assert len(plain) == 32 or plain[-1] in qwen.eos_token_ids
    assert sum(event.accepted_tokens for event in events) > 0


CODE = ("def total(items):\n    result = 0\n    for item in items:\n"
        "        result += item.price\n    return result\n")
EDIT = [{"role": "user", "content": "Rename `result` to `amount` in this function, then say in "
                                    f"a sentence what it does:\n```python\n{CODE}```"}]
CODE_ONLY = [{"role": "user", "content": "Rename `result` to `amount` in this function and "
                                         f"reply with the code only:\n```python\n{CODE}```"}]


def _tokens(qwen: CausalLM, drafter: Drafter | None, request: GenerationRequest
            ) -> tuple[list[int], int, int]:
    """(tokens, drafted, accepted), four draft tokens a round where there is a drafter."""
    policy = FixedSpeculation(4) if drafter is not None else None
    events = list(decode(qwen, drafter, request, policy))
    return ([t for e in events for t in e.token_ids], sum(e.draft_tokens for e in events),
            sum(e.accepted_tokens for e in events))


def test_greedy_with_lookup_is_plain_decoding(qwen: CausalLM) -> None:
    """A code edit, which copies most of its prompt: lookup drafts and is accepted, and
    the answer is plain greedy decoding's, token for token."""
    request = GenerationRequest(prompt_ids=tuple(encode_chat(qwen.tokenizer, CODE_ONLY)),
                                max_new_tokens=32, sampling=SamplingParams(temperature=0.0))
    plain, _, _ = _tokens(qwen, None, request)
    tokens, drafted, accepted = _tokens(qwen, NgramDrafter(), request)
    assert tokens == plain
    assert drafted > 0 and accepted > 0


@needs_draft
def test_keyed_sampling_is_the_same_text_with_lookup_and_the_0_5b_draft(qwen: CausalLM) -> None:
    """With a seed, sampling is keyed by position: the 1.5B's sampled answer is the same
    with no drafter, with lookup and with the 0.5B draft (this seed's answer copies the
    code, so lookup's drafts are both accepted and refused)."""
    keyed = SamplingParams(temperature=1.0, seed=2)
    ids = tuple(encode_chat(qwen.tokenizer, EDIT))
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=48, sampling=keyed)
    plain, _, _ = _tokens(qwen, None, request)
    greedy, _, _ = _tokens(qwen, None, replace(request, sampling=SamplingParams(temperature=0)))
    assert plain != greedy  # the seed's draws, not the argmax
    draft = load_drafter(DRAFT.name, qwen)
    assert draft is not None
    for drafter in (NgramDrafter(), draft):
        tokens, drafted, accepted = _tokens(qwen, drafter, request)
        assert tokens == plain, drafter.name
        assert 0 < accepted < drafted, drafter.name


def test_a_draft_of_another_vocabulary_is_refused(qwen: CausalLM) -> None:
    with pytest.raises(TokenizerMismatchError, match="does not share the target's tokenizer"):
        load_drafter(str(model_store.default_gguf()), qwen)
