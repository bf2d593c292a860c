"""Prompt log-probabilities over HTTP (``/v1/completions`` with ``echo`` and ``logprobs``),
through the official ``openai`` client against a real uvicorn server on the tiny model:
the values a plain forward pass over the prompt gives, in OpenAI's legacy format."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import torch

from decoding.types import FinishReason, RoundEvent, TokenLogprob
from gateway.decode.params import Prompt
from gateway.decode.plan import Job
from gateway.encode.formats import CompletionFormat
from gateway.encode.token_texts import TokenTexts
from gateway.encode.totals import ChoiceTotals
from runtime.runner.causal_lm import CausalLM
from tests.gateway.conftest import TINY, openai_client

PROMPT = "Score every token of this prompt, please."


@pytest.fixture(scope="module")
def client(tiny_url: str) -> openai.OpenAI:
    return openai_client(tiny_url)


def _reference(reference: CausalLM, ids: list[int]) -> torch.Tensor:  # [n - 1, V]
    with torch.inference_mode():
        logits = reference.model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def _check_prompt(logprobs: Any, ids: list[int], reference: CausalLM, top: int) -> None:
    """The first ``len(ids)`` entries are the prompt's, scored as the reference scores it."""
    texts = [reference.tokenizer.decode([t]) for t in ids]
    n = len(ids)
    assert logprobs.tokens[:n] == texts
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = _reference(reference, ids)
    want = expected[torch.arange(n - 1), torch.tensor(ids[1:], dtype=torch.long)]
    got = torch.tensor(logprobs.token_logprobs[1:n])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    for row, alternatives in zip(expected, logprobs.top_logprobs[1:n], strict=True):
        values, indices = torch.topk(row, top)
        assert len(alternatives) == top
        best = reference.tokenizer.decode([int(indices[0])])
        assert alternatives[best] == pytest.approx(float(values[0]), abs=1e-4)
    assert logprobs.text_offset[:n] == [sum(len(t) for t in texts[:i]) for i in range(n)]


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(
        client: openai.OpenAI, tiny_reference: CausalLM) -> None:
    ids = tiny_reference.tokenizer.encode(PROMPT)
    echoed = client.completions.create(model=TINY, prompt=PROMPT, echo=True, logprobs=2,
                                       max_tokens=3, temperature=0)
    plain = client.completions.create(model=TINY, prompt=PROMPT, logprobs=2, max_tokens=3,
                                      temperature=0)
    choice = echoed.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    assert choice.logprobs is not None and plain.choices[0].logprobs is not None
    _check_prompt(choice.logprobs, ids, tiny_reference, top=2)
    completion = plain.choices[0].logprobs
    n = len(ids)
    assert choice.logprobs.tokens[n:] == completion.tokens
    assert choice.logprobs.token_logprobs[n:] == pytest.approx(completion.token_logprobs)
    assert choice.logprobs.text_offset[n:] == [len(PROMPT) + o for o in completion.text_offset]
    assert echoed.usage is not None and echoed.usage.prompt_tokens == n


def test_max_tokens_zero_returns_the_prompt_alone(client: openai.OpenAI,
                                                  tiny_reference: CausalLM) -> None:
    ids = tiny_reference.tokenizer.encode(PROMPT)
    scored = client.completions.create(model=TINY, prompt=ids, echo=True, logprobs=1,
                                       max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == len(ids)
    _check_prompt(choice.logprobs, ids, tiny_reference, top=1)
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    bare = client.completions.create(model=TINY, prompt=PROMPT, echo=True, max_tokens=0)
    assert bare.choices[0].text == PROMPT and bare.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=TINY, prompt=PROMPT, max_tokens=0)
    assert refused.value.param == "max_tokens"


def test_batched_token_prompts_are_scored_each(client: openai.OpenAI,
                                               tiny_reference: CausalLM) -> None:
    """As lm-evaluation-harness sends them: token-id prompts in one request, one
    generated token each."""
    prompts = [tiny_reference.tokenizer.encode(text) for text in
               ("The capital of France is Paris", "Two plus two is four", "Yes")]
    batch = client.completions.create(model=TINY, prompt=prompts, echo=True, logprobs=1,
                                      max_tokens=1, temperature=0, n=2)
    assert sorted(c.index for c in batch.choices) == list(range(6))  # n per prompt
    for choice in batch.choices:
        ids = prompts[choice.index // 2]
        assert choice.logprobs is not None
        assert len(choice.logprobs.tokens) == len(ids) + 1
        _check_prompt(choice.logprobs, ids, tiny_reference, top=1)
        assert choice.logprobs.token_logprobs[-1] is not None


def test_a_stream_scores_the_prompt_in_its_first_chunk(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": TINY, "prompt": PROMPT, "echo": True, "logprobs": 3,
                              "max_tokens": 4, "temperature": 0}
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = list(client.completions.create(**kwargs, stream=True))
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                for key, values in merged.items():
                    values.extend(getattr(choice.logprobs, key))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert whole is not None
    assert merged["tokens"] == whole.tokens and merged["text_offset"] == whole.text_offset
    assert merged["token_logprobs"] == pytest.approx(whole.token_logprobs)


def test_an_echoed_choice_lists_its_final_end_of_sequence_token(
        tiny_target: CausalLM) -> None:
    """The text never shows the end-of-sequence token; an echoed request's logprobs still
    list it, so that prompt + generated entries are all there (a scorer drops the last)."""
    eos = min(tiny_target.eos_token_ids)
    event = RoundEvent(token_ids=(eos,), text="", draft_tokens=0, accepted_tokens=0,
                       logprobs=(TokenLogprob(eos, -0.5),), finish_reason=FinishReason.STOP,
                       prompt_logprobs=(TokenLogprob(7, -1.25),))
    totals = ChoiceTotals(drafter=None)
    for echo, listed in ((True, [None, -1.25, -0.5]), (False, [])):
        job = Job(id="cmpl-1", created=0, model=TINY, prompts=[Prompt(ids=(5, 7), text="ab")],
                  per_prompt=1, logprobs=True, echo=echo)
        fmt = CompletionFormat(job, TokenTexts(tiny_target.tokenizer),
                               tiny_target.eos_token_ids)
        totals.add(event)
        fmt.observe(0, event)
        logprobs = fmt.response([totals]).choices[0].logprobs
        assert logprobs is not None and logprobs.token_logprobs == listed
