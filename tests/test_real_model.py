"""Qwen2.5-Coder-1.5B-Instruct with its 0.5B sibling as the draft, from the catalogue:
loading, the ChatML template, the end tokens and sampling values the pull wrote, and
greedy speculation that is plain decoding token for token. Runs where both are pulled
(`specserve models pull qwen2.5-coder-1.5b`, `specserve models pull qwen2.5-coder-0.5b`)."""

from __future__ import annotations

import pytest

from decoding.prompting import encode_chat
from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams
from drafters.model import ModelDrafter, TokenizerMismatchError
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


def test_a_draft_of_another_vocabulary_is_refused(qwen: CausalLM) -> None:
    with pytest.raises(TokenizerMismatchError, match="does not share the target's tokenizer"):
        load_drafter(str(model_store.default_gguf()), qwen)
